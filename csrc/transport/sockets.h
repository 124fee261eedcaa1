// What the transports that use TCP sockets share: addresses as text, listening sockets, and the
// sockets a forked child must not keep open.
#pragma once

#include <sys/socket.h>

#include <string>

namespace torus {

// `host` (an IPv4 or IPv6 address, or a name) and `port` as a socket address. Throws
// std::invalid_argument when the host does not resolve.
sockaddr_storage parseAddress(const std::string& host, int port, socklen_t* length);
// "host:port", with the host in brackets when it is an IPv6 address.
std::string formatAddress(const sockaddr_storage& address);
// The socket address of "host:port" or "[v6 host]:port".
sockaddr_storage parseHostPort(const std::string& where, socklen_t* length);

// A non-blocking socket listening on `address` (any free port) with room for `backlog` waiting
// connections; *where is set to the "host:port" peers connect to. Throws std::runtime_error.
int listenOn(const std::string& address, int backlog, std::string* where);

// Whether bytes written to `fd` still wait for the peer's kernel to acknowledge them (SIOCOUTQ):
// closing the socket now may lose them.
bool unacknowledged(int fd);

// The sockets of every live transport of this process. A child forked from a rank (a DataLoader
// worker) gets them pointed at /dev/null: otherwise a rank that is SIGKILLed keeps its
// connections open as long as its children live, and its peers never see it go.
void keepFromForkedChildren(int fd);
// Closes `fd` (when >= 0) and forgets it.
void closeSocket(int fd);

} // namespace torus
