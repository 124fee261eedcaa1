#include "transport/ofi/lifelines.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "transport/sockets.h"
#include "transport/transport.h"

namespace torus::ofi {

namespace {

constexpr uint32_t kHelloMagic = 0x6c696665; // "life"
constexpr uint32_t kFarewellMagic = 0x62796521; // "bye!"
constexpr size_t kWhyBytes = 1024;
// What the proofs of a hello and of its acceptance are over (group_secret.h).
const char* const kHelloPurpose = "torus lifeline hello";
const char* const kAcceptPurpose = "torus lifeline accept";

struct FarewellHeader {
  uint32_t magic;
  uint32_t kind;
  uint64_t streamBytes;
  uint64_t readBytes;
  uint32_t whyBytes;
  uint32_t reserved;
};
static_assert(sizeof(FarewellHeader) == 32, "no padding on the wire");

// Keepalive: a host that went down (no process left to close the socket) is found within about
// 10 s of silence plus 3 probes 2 s apart.
void keepAlive(int fd) {
  int on = 1, idle = 10, interval = 2, count = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

} // namespace

Lifelines::Lifelines(const std::string& address, int rank, int size, const std::string& secret,
                     std::chrono::milliseconds helloWait)
    : rank_(rank),
      size_(size),
      helloWait_(helloWait),
      gate_(secret, rank, "lifeline connection"),
      peers_(static_cast<size_t>(size)) {
  listenFd_ = listenOn(address, size, &where_);
}

Lifelines::~Lifelines() {
  closeAll(std::chrono::milliseconds(0));
  closeSocket(listenFd_);
}

void Lifelines::dial(int peer, const std::string& where) {
  Peer& p = peers_[peer];
  socklen_t length = 0;
  sockaddr_storage address{};
  try {
    address = parseHostPort(where, &length);
  } catch (const std::exception& e) {
    end(peer, "its lifeline address '" + where + "' does not resolve");
    return;
  }
  Line line;
  line.fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (line.fd < 0) {
    end(peer, std::string("no socket for its lifeline: ") + std::strerror(errno));
    return;
  }
  keepFromForkedChildren(line.fd);
  keepAlive(line.fd);
  if (::connect(line.fd, reinterpret_cast<const sockaddr*>(&address), length) != 0 && errno != EINPROGRESS) {
    const int error = errno;
    closeSocket(line.fd);
    end(peer, "its lifeline at " + where + " refuses connections (" + std::strerror(error) +
                  "): it exited, was killed or left the group");
    return;
  }
  line.connecting = true;
  line.where = where;
  p.lines.push_back(line);
}

void Lifelines::end(int peer, const std::string& why) {
  Peer& p = peers_[peer];
  if (!p.ended) {
    p.ended = true;
    p.why = why;
    endedUnreported_ = true;
  }
}

bool Lifelines::readLine(Line& line, int* peer, std::string* unproven) {
  char buffer[sizeof(FarewellHeader) + kWhyBytes];
  for (;;) {
    const ssize_t got = ::recv(line.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (got == 0) {
      return false;
    }
    if (got < 0) {
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    }
    line.inbound.append(buffer, static_cast<size_t>(got));
    if (!line.helloRead && line.dialed) {
      // The peer's proof that it accepted this rank's hello: what follows is its to say.
      if (line.inbound.size() < sizeof(Digest)) {
        continue;
      }
      Digest proof;
      std::memcpy(proof.data(), line.inbound.data(), proof.size());
      if (!sameDigest(proof, prove(gate_.secret(), kAcceptPurpose, *peer, rank_, line.nonce))) {
        *unproven = "its acceptance of this rank's lifeline has a wrong proof";
        return false;
      }
      line.helloRead = true;
      line.inbound.erase(0, proof.size());
    }
    if (!line.helloRead) {
      if (line.inbound.size() < sizeof(Hello)) {
        continue;
      }
      Hello hello;
      std::memcpy(&hello, line.inbound.data(), sizeof(hello));
      if (!hello.fits(kHelloMagic, rank_, size_)) {
        *unproven = foreignHello(hello.magic, hello.rank, hello.size);
        return false;
      }
      if (!gate_.admits(kHelloPurpose, hello.rank, hello.nonce, hello.proof)) {
        *unproven = unprovenHello(hello.rank);
        return false;
      }
      const Digest accepted = prove(gate_.secret(), kAcceptPurpose, rank_, hello.rank, hello.nonce);
      // A new socket's buffer takes it at once; a peer that is gone needs none.
      ssize_t ignored = ::send(line.fd, accepted.data(), accepted.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      (void)ignored;
      line.helloRead = true;
      line.inbound.erase(0, sizeof(Hello));
      *peer = hello.rank;
    }
    Peer& p = peers_[*peer];
    if (p.farewell) {
      line.inbound.clear(); // a farewell is the last word: what follows is not kept
      continue;
    }
    if (line.inbound.size() < sizeof(FarewellHeader)) {
      continue;
    }
    FarewellHeader header;
    std::memcpy(&header, line.inbound.data(), sizeof(header));
    if (header.magic != kFarewellMagic || (header.kind != Farewell::kGoodbye && header.kind != Farewell::kFault) ||
        header.whyBytes > kWhyBytes) {
      return false;
    }
    if (line.inbound.size() < sizeof(header) + header.whyBytes) {
      continue;
    }
    p.farewell = Farewell{static_cast<Farewell::Kind>(header.kind), header.streamBytes, header.readBytes,
                          line.inbound.substr(sizeof(header), header.whyBytes)};
  }
}

bool Lifelines::check() {
  for (int fd; listenFd_ >= 0 && (fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0;) {
    keepFromForkedChildren(fd);
    keepAlive(fd);
    Line line;
    line.fd = fd;
    line.deadline = std::chrono::steady_clock::now() + helloWait_;
    unknown_.push_back(line);
  }
  for (size_t i = 0; i < unknown_.size();) {
    int peer = -1;
    std::string unproven;
    bool open = readLine(unknown_[i], &peer, &unproven);
    if (open && peer < 0 && std::chrono::steady_clock::now() >= unknown_[i].deadline) {
      unproven = "it sent no hello within " + std::to_string(helloWait_.count()) + " ms";
      open = false;
    }
    if (!unproven.empty()) {
      gate_.turnAway(peerAddress(unknown_[i].fd), unproven);
    }
    if (peer >= 0) {
      Line line = unknown_[i];
      unknown_.erase(unknown_.begin() + static_cast<std::ptrdiff_t>(i));
      if (open && !peers_[peer].ended) {
        peers_[peer].lines.push_back(line);
        deliverFarewell(peers_[peer], peers_[peer].lines.back());
      } else {
        closeSocket(line.fd);
        end(peer, rankName(peer) + " closed its lifeline (the process exited, was killed or aborted its group)");
      }
    } else if (!open) {
      closeSocket(unknown_[i].fd); // no peer of this group
      unknown_.erase(unknown_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  for (int peer = 0; peer < size_; ++peer) {
    Peer& p = peers_[peer];
    if (p.ended) {
      continue;
    }
    for (Line& line : p.lines) {
      if (line.connecting) {
        if (!finishDial(peer, line)) {
          break;
        }
        if (line.connecting) {
          continue;
        }
      }
      int self = peer;
      std::string unproven;
      if (!readLine(line, &self, &unproven)) {
        if (!unproven.empty()) {
          gate_.turnAway(line.where, unproven);
        }
        end(peer, unproven.empty() ? rankName(peer) +
                                         " closed its lifeline (the process exited, was killed or aborted its group)"
                                   : "the process at " + rankName(peer) + "'s lifeline address " + line.where +
                                         " did not prove it belongs to the group");
        break;
      }
    }
  }
  return std::exchange(endedUnreported_, false);
}

bool Lifelines::finishDial(int peer, Line& line) {
  pollfd pfd{line.fd, POLLOUT, 0};
  if (::poll(&pfd, 1, 0) == 0) {
    return true;
  }
  int error = 0;
  socklen_t length = sizeof(error);
  ::getsockopt(line.fd, SOL_SOCKET, SO_ERROR, &error, &length);
  line.nonce = freshNonce();
  Hello hello{kHelloMagic, rank_, size_, line.nonce, prove(gate_.secret(), kHelloPurpose, rank_, peer, line.nonce)};
  if (error != 0 || ::send(line.fd, &hello, sizeof(hello), MSG_NOSIGNAL | MSG_DONTWAIT) != sizeof(hello)) {
    end(peer, rankName(peer) + " refuses its lifeline (" + std::strerror(error ? error : errno) +
                  "): it exited, was killed or left the group");
    return false;
  }
  line.connecting = false;
  line.dialed = true;
  deliverFarewell(peers_[peer], line);
  return true;
}

bool Lifelines::helloSent(int peer) {
  Peer& p = peers_[peer];
  for (Line& line : p.lines) {
    if (!p.ended && line.connecting && finishDial(peer, line) && line.connecting) {
      return false;
    }
  }
  return true;
}

void Lifelines::watch(std::vector<pollfd>& fds) const {
  if (listenFd_ >= 0) {
    fds.push_back({listenFd_, POLLIN, 0});
  }
  for (const Line& line : unknown_) {
    fds.push_back({line.fd, POLLIN, 0});
  }
  for (const Peer& p : peers_) {
    if (p.ended) {
      continue;
    }
    for (const Line& line : p.lines) {
      fds.push_back({line.fd, static_cast<short>(line.connecting ? POLLOUT : POLLIN), 0});
    }
  }
}

bool Lifelines::peerWaiting() const {
  if (!unknown_.empty()) {
    return true;
  }
  pollfd pfd{listenFd_, POLLIN, 0};
  return listenFd_ >= 0 && ::poll(&pfd, 1, 0) > 0;
}

void Lifelines::sayFarewell(int peer, const Farewell& farewell) {
  Peer& p = peers_[peer];
  if (!p.farewellBytes.empty()) {
    return;
  }
  const std::string why = farewell.why.substr(0, kWhyBytes);
  FarewellHeader header{kFarewellMagic, farewell.kind, farewell.streamBytes, farewell.readBytes,
                        static_cast<uint32_t>(why.size()), 0};
  p.farewellBytes.assign(reinterpret_cast<const char*>(&header), sizeof(header));
  p.farewellBytes += why;
  for (Line& line : p.lines) {
    deliverFarewell(p, line);
  }
}

void Lifelines::deliverFarewell(Peer& p, Line& line) {
  if (p.farewellBytes.empty() || line.connecting || line.saidFarewell) {
    return;
  }
  line.saidFarewell = true;
  // A new socket's buffer takes the whole farewell at once; a peer that is gone needs none.
  ssize_t ignored = ::send(line.fd, p.farewellBytes.data(), p.farewellBytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)ignored;
  ::shutdown(line.fd, SHUT_WR);
}

void Lifelines::closeAll(std::chrono::milliseconds linger) {
  const auto until = std::chrono::steady_clock::now() + linger;
  // Lines that peers dialed and this rank has not taken yet get the farewell too, where their
  // Hello is there to say whose they are.
  check();
  for (Peer& p : peers_) {
    for (Line& line : p.lines) {
      while (line.saidFarewell && !p.ended && unacknowledged(line.fd) && std::chrono::steady_clock::now() < until) {
        char drain[256];
        while (::recv(line.fd, drain, sizeof(drain), MSG_DONTWAIT) > 0) {
        }
        pollfd pfd{line.fd, POLLIN, 0};
        ::poll(&pfd, 1, 1);
      }
      closeSocket(line.fd);
    }
    p.lines.clear();
  }
  for (Line& line : unknown_) {
    closeSocket(line.fd);
  }
  unknown_.clear();
}

std::string goodbyeWhy(Departure departure) {
  return departure == Departure::kProcessEnded ? "its process ended" : "";
}

} // namespace torus::ofi
