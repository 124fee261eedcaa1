#include "transport/tcp/tcp_listener.h"

#include <stdexcept>

#include "transport/sockets.h"

namespace torus {

TcpListener::TcpListener(const std::string& address, int backlog) {
  fd_ = listenOn(address, backlog, &where_); // where_ is constructed by now
}

TcpListener::~TcpListener() {
  closeSocket(fd_);
}

int TcpListener::release() {
  if (fd_ < 0) {
    throw std::logic_error("torus: a TCP listener's socket was handed to two transports");
  }
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

} // namespace torus
