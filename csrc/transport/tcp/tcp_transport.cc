#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace torus {

namespace {

constexpr uint32_t kHelloMagic = 0x746f7275; // "toru"
// How long progress sleeps in poll() at most; a sleep that ends with nothing to read or write
// runs the message layer's idle checks.
constexpr int kIdleCheckMs = 100;
struct Hello {
  uint32_t magic;
  int32_t rank;
};

std::string systemError(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

int millisecondsUntil(Deadline deadline, int cap) {
  if (deadline == Deadline::max()) {
    return cap;
  }
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left + 1, cap)));
}

void setSocketOptions(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// Handshake I/O happens before the sockets are non-blocking; poll bounds it by the deadline.
void readExactly(int fd, void* buf, size_t n, Deadline deadline, const std::string& what) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    int ready = ::poll(&pfd, 1, millisecondsUntil(deadline, 1000));
    if (ready < 0 && errno != EINTR) {
      throw CommError(CommError::Kind::kPeer, systemError(what));
    }
    if (ready <= 0) {
      if (Clock::now() >= deadline) {
        throw CommError(CommError::Kind::kTimeout, "timed out during " + what);
      }
      continue;
    }
    ssize_t got = ::recv(fd, p, n, 0);
    if (got == 0) {
      throw CommError(CommError::Kind::kPeer, what + ": connection closed");
    }
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) {
        continue;
      }
      throw CommError(CommError::Kind::kPeer, systemError(what));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
}

// A connected socket to `address`, trying again while the peer refuses or the network does not
// answer, until `deadline`: a blocking connect to an address that drops packets would wait out
// the kernel's SYN retries (minutes) whatever the group's timeout.
int connectBefore(const sockaddr_in& address, Deadline deadline, const std::string& what) {
  for (;;) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      throw CommError(CommError::Kind::kPeer, systemError(what));
    }
    int err = 0;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
      err = errno;
    }
    if (err == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      const int ready = ::poll(&pfd, 1, millisecondsUntil(deadline, 1000));
      socklen_t len = sizeof(err);
      err = ready > 0 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 ? err : ETIMEDOUT;
    }
    if (err == 0) {
      return fd;
    }
    ::close(fd);
    const bool retry = err == ECONNREFUSED || err == EINTR || err == ETIMEDOUT || err == EHOSTUNREACH ||
                       err == ENETUNREACH || err == ECONNRESET;
    if (!retry) {
      errno = err;
      throw CommError(CommError::Kind::kPeer, systemError(what));
    }
    if (Clock::now() >= deadline) {
      errno = err;
      throw CommError(CommError::Kind::kTimeout, systemError(what + " before the group's timeout"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The sockets of every live TcpTransport of this process. A child forked from a rank (a
// DataLoader worker) gets them pointed at /dev/null: otherwise a rank that is SIGKILLed keeps
// its connections open as long as its children live, and its peers never see it go.
class ForkedChildSockets {
 public:
  static ForkedChildSockets& instance() {
    // Never destroyed: fork handlers outlive static destructors.
    static ForkedChildSockets* sockets = [] {
      ::pthread_atfork(&beforeFork, &inParent, &inChild);
      return new ForkedChildSockets();
    }();
    return *sockets;
  }
  void add(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    fds_.insert(fd);
  }
  void remove(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    fds_.erase(fd);
  }

 private:
  static void beforeFork() {
    instance().mutex_.lock();
  }
  static void inParent() {
    instance().mutex_.unlock();
  }
  // In the child, with only async-signal-safe calls.
  static void inChild() {
    ForkedChildSockets& sockets = instance();
    const int devNull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devNull >= 0) {
      for (int fd : sockets.fds_) {
        ::dup3(devNull, fd, O_CLOEXEC);
      }
      ::close(devNull);
    }
    sockets.mutex_.unlock();
  }

  std::mutex mutex_;
  std::set<int> fds_;
};

sockaddr_in parseAddress(const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    addrinfo* result = nullptr;
    if (::getaddrinfo(host.c_str(), nullptr, &hints, &result) != 0 || result == nullptr) {
      throw std::invalid_argument("torus: cannot resolve address '" + host + "'");
    }
    addr.sin_addr = reinterpret_cast<sockaddr_in*>(result->ai_addr)->sin_addr;
    ::freeaddrinfo(result);
  }
  return addr;
}

} // namespace

// One connection: the Link the message layer reads and writes.
struct TcpTransport::Pair : Link {
  int peer = -1;
  int fd = -1;

  size_t write(const iovec* parts, int count) override {
    msghdr msg{};
    msg.msg_iov = const_cast<iovec*>(parts);
    msg.msg_iovlen = static_cast<size_t>(count);
    ssize_t sent = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent >= 0) {
      return static_cast<size_t>(sent);
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      return 0;
    }
    throw CommError(CommError::Kind::kPeer, systemError("connection to rank " + std::to_string(peer) + " failed"));
  }

  ssize_t read(char* dst, size_t n) override {
    ssize_t got = ::recv(fd, dst, n, MSG_DONTWAIT);
    if (got > 0) {
      return got;
    }
    if (got == 0) {
      return -1;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      return 0;
    }
    throw CommError(CommError::Kind::kPeer, systemError("connection to rank " + std::to_string(peer) + " failed"));
  }
};

TcpTransport::TcpTransport(int rank, int size, Rendezvous& rendezvous, const TcpOptions& options)
    : MessageTransport(rank, size, options.messages), pairs_(static_cast<size_t>(size)) {
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakeFd_ < 0) {
    throw std::runtime_error(systemError("torus: eventfd"));
  }
  try {
    connectAll(rendezvous, Clock::now() + options.timeout, options.address);
  } catch (...) {
    for (auto& pair : pairs_) {
      if (pair && pair->fd >= 0) {
        ::close(pair->fd);
      }
    }
    ::close(wakeFd_);
    if (listenFd_ >= 0) {
      ::close(listenFd_);
    }
    throw;
  }
  joinHelper();
}

TcpTransport::~TcpTransport() {
  leaveHelper();
  WireHeader goodbye;
  goodbye.kind = kGoodbyeFrame;
  for (auto& pair : pairs_) {
    if (pair && pair->fd >= 0) {
      // Best effort, only between whole frames: a connection mid-frame (or full) just closes.
      if (peerFailure(pair->peer).empty() && betweenFrames(pair->peer)) {
        ssize_t ignored = ::send(pair->fd, &goodbye, sizeof(goodbye), MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)ignored;
      }
      ForkedChildSockets::instance().remove(pair->fd);
      ::close(pair->fd);
    }
  }
  if (listenFd_ >= 0) {
    ::close(listenFd_);
  }
  ::close(wakeFd_);
}

void TcpTransport::connectAll(Rendezvous& rendezvous, Deadline deadline, const std::string& address) {
  if (size() == 1) {
    return;
  }
  listenFd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listenFd_ < 0) {
    throw std::runtime_error(systemError("torus: socket"));
  }
  int one = 1;
  ::setsockopt(listenFd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in bindAddr = parseAddress(address, 0);
  if (::bind(listenFd_, reinterpret_cast<sockaddr*>(&bindAddr), sizeof(bindAddr)) != 0) {
    throw std::runtime_error(systemError("torus: cannot listen on address '" + address + "'"));
  }
  if (::listen(listenFd_, size()) != 0) {
    throw std::runtime_error(systemError("torus: listen"));
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(listenFd_, reinterpret_cast<sockaddr*>(&bound), &len);
  char host[INET_ADDRSTRLEN];
  ::inet_ntop(AF_INET, &bound.sin_addr, host, sizeof(host));
  rendezvous.set("tcp/" + std::to_string(rank()), std::string(host) + ":" + std::to_string(ntohs(bound.sin_port)));

  // Lower ranks accept, higher ranks connect: a connect completes through the listen backlog,
  // so no rank waits on another that is still connecting.
  for (int peer = 0; peer < rank(); ++peer) {
    std::string where = rendezvous.get("tcp/" + std::to_string(peer));
    auto colon = where.rfind(':');
    sockaddr_in peerAddr = parseAddress(where.substr(0, colon), std::stoi(where.substr(colon + 1)));
    const int fd = connectBefore(peerAddr, deadline, "torus: rank " + std::to_string(rank()) +
                                                        " cannot connect to rank " + std::to_string(peer) + " at " +
                                                        where);
    Hello hello{kHelloMagic, rank()};
    if (::send(fd, &hello, sizeof(hello), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hello))) {
      ::close(fd);
      throw CommError(CommError::Kind::kPeer, systemError("torus: handshake with rank " + std::to_string(peer)));
    }
    pairs_[peer] = std::make_unique<Pair>();
    pairs_[peer]->peer = peer;
    pairs_[peer]->fd = fd;
  }
  for (int accepted = 0; accepted < size() - 1 - rank(); ++accepted) {
    pollfd pfd{listenFd_, POLLIN, 0};
    int ready = ::poll(&pfd, 1, millisecondsUntil(deadline, 1000));
    if (ready <= 0) {
      if (Clock::now() >= deadline) {
        throw CommError(CommError::Kind::kTimeout,
                        "torus: rank " + std::to_string(rank()) + " timed out waiting for higher ranks to connect");
      }
      --accepted;
      continue;
    }
    int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      --accepted;
      continue;
    }
    Hello hello{};
    readExactly(fd, &hello, sizeof(hello), deadline, "torus: handshake");
    if (hello.magic != kHelloMagic || hello.rank <= rank() || hello.rank >= size() || pairs_[hello.rank]) {
      ::close(fd);
      throw CommError(CommError::Kind::kPeer, "torus: unexpected handshake from a process claiming rank " +
                                                  std::to_string(hello.rank));
    }
    pairs_[hello.rank] = std::make_unique<Pair>();
    pairs_[hello.rank]->peer = hello.rank;
    pairs_[hello.rank]->fd = fd;
  }
  ::close(listenFd_);
  listenFd_ = -1;
  for (auto& pair : pairs_) {
    if (pair) {
      setSocketOptions(pair->fd);
      ForkedChildSockets::instance().add(pair->fd);
      attach(pair->peer, pair.get());
    }
  }
}

void TcpTransport::announceAbort(const std::string& why) {
  // A fault frame can only go between whole frames, and only if the socket takes all of it at
  // once (the peer would misread anything less); otherwise the end of the stream tells the peer.
  const std::string text = why.substr(0, kFaultTextBytes);
  WireHeader header;
  header.kind = kFaultFrame;
  header.nbytes = text.size();
  for (auto& pair : pairs_) {
    if (!pair || !peerFailure(pair->peer).empty()) {
      continue;
    }
    iovec parts[2] = {{&header, sizeof(header)}, {const_cast<char*>(text.data()), text.size()}};
    msghdr msg{};
    msg.msg_iov = parts;
    msg.msg_iovlen = 2;
    if (!betweenFrames(pair->peer) ||
        ::sendmsg(pair->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof(header) + text.size())) {
      ::shutdown(pair->fd, SHUT_WR);
    }
  }
}

void TcpTransport::wakeSleeper() {
  uint64_t one = 1;
  ssize_t ignored = ::write(wakeFd_, &one, sizeof(one));
  (void)ignored;
}

bool TcpTransport::sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) {
  std::vector<pollfd> fds;
  std::vector<int> polled;
  fds.reserve(pairs_.size() + 1);
  fds.push_back({wakeFd_, POLLIN, 0});
  for (auto& pair : pairs_) {
    if (pair && peerFailure(pair->peer).empty()) {
      fds.push_back({pair->fd, static_cast<short>(POLLIN | (wantsToWrite(pair->peer) ? POLLOUT : 0)), 0});
      polled.push_back(pair->peer);
    }
  }
  lock.unlock();
  int ready = ::poll(fds.data(), fds.size(), millisecondsUntil(deadline, kIdleCheckMs));
  lock.lock();
  if (ready <= 0) {
    return ready < 0;
  }
  if (fds[0].revents) {
    uint64_t drained;
    ssize_t ignored = ::read(wakeFd_, &drained, sizeof(drained));
    (void)ignored;
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents) {
      tryPeer(polled[i - 1]);
    }
  }
  return true;
}

} // namespace torus
