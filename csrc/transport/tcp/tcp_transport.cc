#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

namespace torus {

namespace {

struct WireHeader {
  uint64_t tag;
  uint64_t nbytes;
  CallSignature call;
};

constexpr uint32_t kHelloMagic = 0x746f7275; // "toru"
// The last header a transport sends on each connection when it is destroyed: the end of the
// stream that follows is a departure, not a death.
constexpr uint64_t kGoodbyeTag = UINT64_MAX;
// A header whose payload is the text of why the sender gave up on the group (abort()).
constexpr uint64_t kFaultTag = UINT64_MAX - 1;
constexpr size_t kFaultTextBytes = 4096;
// How long progress sleeps in poll() at most; a sleep that ends with nothing to read or write
// checks held messages against posted receives (see checkHeldCalls).
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

struct TcpTransport::Op : PendingOp {
  WireHeader header{};
};

struct TcpTransport::Pair {
  int peer = -1;
  int fd = -1;
  std::string failure;

  // Sends go out in order; the head may be partly written.
  std::deque<std::shared_ptr<Op>> sends;
  size_t headSent = 0;

  // The message being read: its header, then its payload into `target` (a posted receive) or
  // into `holding` (nobody asked for it yet).
  WireHeader header{};
  size_t headerRead = 0;
  bool inPayload = false;
  size_t payloadRead = 0;
  std::shared_ptr<Op> target;
  bool discard = false;
  std::vector<char> holding;

  std::map<uint64_t, std::deque<std::shared_ptr<Op>>> posted;
  struct Held {
    CallSignature call;
    std::vector<char> payload;
  };
  std::map<uint64_t, std::deque<Held>> arrived;
  // The peer said goodbye: it destroyed its group, so its end of stream is no failure of ours.
  bool left = false;
  // The last collective this rank sent the peer a probe about.
  uint64_t probedTag = UINT64_MAX;
};

TcpTransport::TcpTransport(int rank, int size, Rendezvous& rendezvous, const TcpOptions& options)
    : rank_(rank), size_(size), pairs_(static_cast<size_t>(size)) {
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
}

TcpTransport::~TcpTransport() {
  const WireHeader goodbye{kGoodbyeTag, 0, {}};
  for (auto& pair : pairs_) {
    if (pair && pair->fd >= 0) {
      // Best effort, only between whole messages: a connection mid-message (or full) just closes.
      if (pair->failure.empty() && pair->headSent == 0) {
        ssize_t ignored = ::send(pair->fd, &goodbye, sizeof(goodbye), MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)ignored;
      }
      ::close(pair->fd);
    }
  }
  if (listenFd_ >= 0) {
    ::close(listenFd_);
  }
  ::close(wakeFd_);
}

void TcpTransport::connectAll(Rendezvous& rendezvous, Deadline deadline, const std::string& address) {
  if (size_ == 1) {
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
  if (::listen(listenFd_, size_) != 0) {
    throw std::runtime_error(systemError("torus: listen"));
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(listenFd_, reinterpret_cast<sockaddr*>(&bound), &len);
  char host[INET_ADDRSTRLEN];
  ::inet_ntop(AF_INET, &bound.sin_addr, host, sizeof(host));
  rendezvous.set("tcp/" + std::to_string(rank_), std::string(host) + ":" + std::to_string(ntohs(bound.sin_port)));

  // Lower ranks accept, higher ranks connect: a connect completes through the listen backlog,
  // so no rank waits on another that is still connecting.
  for (int peer = 0; peer < rank_; ++peer) {
    std::string where = rendezvous.get("tcp/" + std::to_string(peer));
    auto colon = where.rfind(':');
    sockaddr_in peerAddr = parseAddress(where.substr(0, colon), std::stoi(where.substr(colon + 1)));
    int fd = -1;
    for (;;) {
      fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&peerAddr), sizeof(peerAddr)) == 0) {
        break;
      }
      int err = errno;
      ::close(fd);
      if ((err != ECONNREFUSED && err != EINTR && err != ETIMEDOUT) || Clock::now() >= deadline) {
        errno = err;
        throw CommError(CommError::Kind::kPeer,
                        systemError("torus: rank " + std::to_string(rank_) + " cannot connect to rank " +
                                    std::to_string(peer) + " at " + where));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Hello hello{kHelloMagic, rank_};
    if (::send(fd, &hello, sizeof(hello), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hello))) {
      ::close(fd);
      throw CommError(CommError::Kind::kPeer, systemError("torus: handshake with rank " + std::to_string(peer)));
    }
    pairs_[peer] = std::make_unique<Pair>();
    pairs_[peer]->peer = peer;
    pairs_[peer]->fd = fd;
  }
  for (int accepted = 0; accepted < size_ - 1 - rank_; ++accepted) {
    pollfd pfd{listenFd_, POLLIN, 0};
    int ready = ::poll(&pfd, 1, millisecondsUntil(deadline, 1000));
    if (ready <= 0) {
      if (Clock::now() >= deadline) {
        throw CommError(CommError::Kind::kTimeout,
                        "torus: rank " + std::to_string(rank_) + " timed out waiting for higher ranks to connect");
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
    if (hello.magic != kHelloMagic || hello.rank <= rank_ || hello.rank >= size_ || pairs_[hello.rank]) {
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
    }
  }
}

RequestPtr TcpTransport::isend(int peer, uint64_t tag, const CallSignature& call, const void* buf, size_t nbytes) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw std::invalid_argument("torus: invalid send peer " + std::to_string(peer));
  }
  auto op = makeOp<Op>(this, true, peer, tag, call, buf, nbytes);
  op->header = WireHeader{tag, nbytes, call};
  std::lock_guard<std::mutex> lock(mutex_);
  Pair& pair = *pairs_[peer];
  if (!abortReason_.empty()) {
    op->fail(CommError::Kind::kAborted, abortReason_);
  } else if (!pair.failure.empty()) {
    op->fail(CommError::Kind::kPeer, pair.failure);
  } else {
    pair.sends.push_back(op);
    if (pair.sends.size() == 1) {
      trySend(pair);
    }
    if (!op->complete && progressing_) {
      wake(); // the driving thread must start watching this socket for writability
    }
  }
  return op;
}

RequestPtr TcpTransport::irecv(int peer, uint64_t tag, const CallSignature& call, void* buf, size_t nbytes) {
  if (peer != kAnyPeer && (peer < 0 || peer >= size_ || peer == rank_)) {
    throw std::invalid_argument("torus: invalid receive peer " + std::to_string(peer));
  }
  auto op = makeOp<Op>(this, false, peer, tag, call, buf, nbytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!abortReason_.empty()) {
    op->fail(CommError::Kind::kAborted, abortReason_);
    return op;
  }
  postReceive(op, peer, tag, pairs_, anyPeerReceives_, [&](Pair& pair, Op& receive) {
    auto held = popOldest(pair.arrived, tag);
    if (!held) {
      return false;
    }
    receive.peerRank = pair.peer;
    if (receive.accepts(pair.peer, held->call, held->payload.size())) {
      std::memcpy(buf, held->payload.data(), nbytes);
      receive.complete = true;
    }
    return true;
  });
  return op;
}

std::shared_ptr<TcpTransport::Op> TcpTransport::matchPosted(Pair& pair, uint64_t tag) {
  return matchPostedReceive(pair.posted, anyPeerReceives_, tag, pair.peer);
}

bool TcpTransport::trySend(Pair& pair) {
  bool completed = false;
  while (!pair.sends.empty() && pair.failure.empty()) {
    Op& op = *pair.sends.front();
    const size_t total = sizeof(WireHeader) + op.nbytes;
    iovec iov[2];
    int iovcnt = 0;
    if (pair.headSent < sizeof(WireHeader)) {
      iov[iovcnt++] = {reinterpret_cast<char*>(&op.header) + pair.headSent, sizeof(WireHeader) - pair.headSent};
      if (op.nbytes > 0) {
        iov[iovcnt++] = {op.buf, op.nbytes};
      }
    } else {
      size_t offset = pair.headSent - sizeof(WireHeader);
      iov[iovcnt++] = {op.buf + offset, op.nbytes - offset};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    ssize_t sent = ::sendmsg(pair.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        return completed;
      }
      failPair(pair, systemError("connection to rank " + std::to_string(pair.peer) + " failed"));
      return true;
    }
    pair.headSent += static_cast<size_t>(sent);
    if (pair.headSent == total) {
      op.complete = true;
      pair.sends.pop_front();
      pair.headSent = 0;
      completed = true;
    }
  }
  return completed;
}

bool TcpTransport::tryRecv(Pair& pair) {
  bool completed = false;
  while (pair.failure.empty()) {
    char* dst;
    size_t want;
    if (!pair.inPayload) {
      dst = reinterpret_cast<char*>(&pair.header) + pair.headerRead;
      want = sizeof(WireHeader) - pair.headerRead;
    } else {
      char* base = pair.target ? pair.target->buf : pair.holding.data();
      dst = base + pair.payloadRead;
      want = pair.header.nbytes - pair.payloadRead;
    }
    ssize_t got = want == 0 ? 0 : ::recv(pair.fd, dst, want, MSG_DONTWAIT);
    if (want > 0 && got == 0) {
      if (pair.inPayload && pair.header.tag == kFaultTag) {
        failPair(pair, "rank " + std::to_string(pair.peer) + " gave up on the group: " +
                           std::string(pair.holding.data(), pair.payloadRead));
      } else if (pair.left) {
        // Requests still owed by a rank that destroyed its group fail; the group lives on.
        pair.failure = "rank " + std::to_string(pair.peer) + " left the group (destroyed its process group)";
        failPending(pair, CommError::Kind::kPeer, pair.failure);
      } else {
        failPair(pair, "rank " + std::to_string(pair.peer) +
                           " closed its connection (the process exited, was killed or aborted its group)");
      }
      return true;
    }
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        return completed;
      }
      failPair(pair, systemError("connection to rank " + std::to_string(pair.peer) + " failed"));
      return true;
    }
    if (!pair.inPayload) {
      pair.headerRead += static_cast<size_t>(got);
      if (pair.headerRead < sizeof(WireHeader)) {
        continue;
      }
      pair.headerRead = 0;
      if (pair.header.tag == kGoodbyeTag) {
        pair.left = true;
        continue;
      }
      pair.inPayload = true;
      pair.payloadRead = 0;
      pair.discard = false;
      if (pair.header.tag == kFaultTag) {
        pair.header.nbytes = std::min<uint64_t>(pair.header.nbytes, kFaultTextBytes);
      } else if (pair.header.tag != kProbeTag) {
        pair.target = matchPosted(pair, pair.header.tag);
      }
      if (pair.target && !pair.target->accepts(pair.peer, pair.header.call, pair.header.nbytes)) {
        pair.target.reset();
        pair.discard = true;
        completed = true;
      }
      if (!pair.target) {
        pair.holding.resize(pair.header.nbytes);
      }
    } else {
      pair.payloadRead += static_cast<size_t>(got);
    }
    if (pair.inPayload && pair.payloadRead == pair.header.nbytes) {
      pair.inPayload = false;
      if (pair.header.tag == kFaultTag) {
        failPair(pair, "rank " + std::to_string(pair.peer) + " gave up on the group: " +
                           std::string(pair.holding.begin(), pair.holding.end()));
        return true;
      }
      if (pair.header.tag == kProbeTag) {
        uint64_t probed = 0;
        std::memcpy(&probed, pair.holding.data(), std::min(pair.holding.size(), sizeof(probed)));
        failDisagreeing(pair.peer, probed, pair.header.call);
        pair.holding = {};
      } else if (pair.target) {
        pair.target->complete = true;
        pair.target.reset();
      } else if (!pair.discard) {
        deliver(pair, pair.header.tag, pair.header.call, std::move(pair.holding));
        pair.holding = {};
      }
      completed = true;
    }
  }
  return completed;
}

void TcpTransport::deliver(Pair& pair, uint64_t tag, const CallSignature& call, std::vector<char>&& payload) {
  // A receive may have been posted while this message was being read.
  if (auto op = matchPosted(pair, tag)) {
    if (op->accepts(pair.peer, call, payload.size())) {
      std::memcpy(op->buf, payload.data(), payload.size());
      op->complete = true;
    }
    return;
  }
  pair.arrived[tag].push_back({call, std::move(payload)});
}

bool TcpTransport::failDisagreeing(int sender, uint64_t tag, const CallSignature& call) {
  bool failed = false;
  for (auto& pair : pairs_) {
    if (pair) {
      failed |= failDisagreeingIn(pair->posted, sender, tag, call);
    }
  }
  return failDisagreeingIn(anyPeerReceives_, sender, tag, call) || failed;
}

bool TcpTransport::checkHeldCalls() {
  // A message nobody has asked for, of a call that disagrees with a receive posted for the same
  // collective from another rank: the two ranks called different collectives (or the same one
  // with different peers), which no first message between them shows.
  bool failed = false;
  for (auto& sender : pairs_) {
    if (sender) {
      for (auto& [tag, held] : sender->arrived) {
        failed |= failDisagreeing(sender->peer, tag, held.front().call);
      }
    }
  }
  return failed;
}

void TcpTransport::probeWaits() {
  for (auto& pair : pairs_) {
    if (!pair || !pair->failure.empty()) {
      continue;
    }
    for (auto& probe : probesFor<Op>(*pair)) {
      probe->header = WireHeader{kProbeTag, sizeof(probe->probedTag), probe->call};
      pair->sends.push_back(probe);
      if (pair->sends.size() == 1) {
        trySend(*pair);
      }
    }
  }
}

void TcpTransport::failPending(Pair& pair, CommError::Kind kind, const std::string& why) {
  for (auto& op : pair.sends) {
    op->fail(kind, why);
  }
  pair.sends.clear();
  failQueued(pair.posted, kind, why);
  if (pair.target) {
    pair.target->fail(kind, why);
    pair.target.reset();
    pair.discard = true;
  }
}

void TcpTransport::failPair(Pair& pair, const std::string& why) {
  if (!pair.failure.empty()) {
    return;
  }
  failEveryPeer(pairs_, anyPeerReceives_, why, [&](Pair& other) { failPending(other, CommError::Kind::kPeer, why); });
}

std::optional<Transport::StrayMessage> TcpTransport::strayMessage(uint64_t upToTag) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& pair : pairs_) {
    if (pair && !pair->arrived.empty() && pair->arrived.begin()->first <= upToTag) {
      return StrayMessage{pair->peer, pair->arrived.begin()->first, pair->arrived.begin()->second.front().call};
    }
  }
  return std::nullopt;
}

void TcpTransport::tellFault(Pair& pair, const std::string& why) {
  // A fault frame can only go between whole messages, and only if the socket takes all of it at
  // once (the peer would misread anything less); otherwise the end of the stream tells the peer.
  const std::string text = why.substr(0, kFaultTextBytes);
  WireHeader header{kFaultTag, text.size(), {}};
  iovec iov[2] = {{&header, sizeof(header)}, {const_cast<char*>(text.data()), text.size()}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = 2;
  if (pair.headSent != 0 ||
      ::sendmsg(pair.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof(header) + text.size())) {
    ::shutdown(pair.fd, SHUT_WR);
  }
}

void TcpTransport::wake() {
  uint64_t one = 1;
  ssize_t ignored = ::write(wakeFd_, &one, sizeof(one));
  (void)ignored;
}

bool TcpTransport::tryAll() {
  bool moved = false;
  for (auto& pair : pairs_) {
    if (pair && pair->failure.empty()) {
      moved |= trySend(*pair);
      moved |= tryRecv(*pair);
    }
  }
  return moved;
}

void TcpTransport::progress(std::unique_lock<std::mutex>& lock, Deadline deadline) {
  if (spinBriefly(lock)) {
    return;
  }
  std::vector<pollfd> fds;
  std::vector<Pair*> polled;
  fds.reserve(pairs_.size() + 1);
  fds.push_back({wakeFd_, POLLIN, 0});
  for (auto& pair : pairs_) {
    if (pair && pair->failure.empty()) {
      short events = POLLIN;
      if (!pair->sends.empty()) {
        events |= POLLOUT;
      }
      fds.push_back({pair->fd, events, 0});
      polled.push_back(pair.get());
    }
  }
  lock.unlock();
  int ready = ::poll(fds.data(), fds.size(), millisecondsUntil(deadline, kIdleCheckMs));
  lock.lock();
  if (ready == 0) {
    checkHeldCalls();
    probeWaits();
  }
  if (ready <= 0) {
    return;
  }
  if (fds[0].revents) {
    uint64_t drained;
    ssize_t ignored = ::read(wakeFd_, &drained, sizeof(drained));
    (void)ignored;
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents & (POLLOUT | POLLERR | POLLHUP)) {
      trySend(*polled[i - 1]);
    }
    if (fds[i].revents & (POLLIN | POLLERR | POLLHUP)) {
      tryRecv(*polled[i - 1]);
    }
  }
}

void TcpTransport::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!abortReason_.empty()) {
    return;
  }
  abortReason_ = why;
  for (auto& pair : pairs_) {
    if (!pair) {
      continue;
    }
    if (pair->failure.empty()) {
      tellFault(*pair, why);
    }
    failPending(*pair, CommError::Kind::kAborted, why);
    pair->failure = why;
  }
  failQueued(anyPeerReceives_, CommError::Kind::kAborted, why);
  wake();
  progressed_.notify_all();
}

} // namespace torus
