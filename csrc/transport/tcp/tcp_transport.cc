#include "transport/tcp/tcp_transport.h"

#include "transport/group_secret.h"
#include "transport/sockets.h"

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
#include <mutex>
#include <sstream>
#include <thread>

namespace torus {

namespace {

constexpr uint32_t kHelloMagic = 0x746f7275; // "toru"
constexpr uint32_t kAccepted = 0x6f6b6179; // "okay"
constexpr uint32_t kRefused = 0x6e6f7065; // "nope"
constexpr uint32_t kGaveUp = 0x71756974; // "quit", then the reason's bytes
// A refused rank connects again after this, in case the peer's own connection never comes.
constexpr auto kRetryAfterRefusal = std::chrono::milliseconds(200);

// What the proofs of a hello and of its acceptance are over (group_secret.h).
const char* const kHelloPurpose = "torus tcp hello";
const char* const kAcceptPurpose = "torus tcp accept";

static_assert(sizeof(Hello) == sizeof(TcpTransport::Incoming::hello), "Incoming::hello holds one");
struct Verdict {
  uint32_t code;
  uint32_t reasonBytes; // kGaveUp: the reason's length (at most kFaultTextBytes)
  // kAccepted: prove(kAcceptPurpose, the accepting rank, the dialing one, the hello's nonce). Only
  // an acceptance needs one: whoever holds a peer's address can refuse a connection anyway.
  Digest proof;
};

// Answers a connection with `code` (and, for kGaveUp, `reason`); best effort: a new socket's
// buffer takes the whole answer at once, and a peer that is gone needs none.
bool sendVerdict(int fd, uint32_t code, const std::string& reason = "", const Digest& proof = {}) {
  const std::string text = reason.substr(0, kFaultTextBytes);
  Verdict verdict{code, static_cast<uint32_t>(text.size()), proof};
  iovec parts[2] = {{&verdict, sizeof(verdict)}, {const_cast<char*>(text.data()), text.size()}};
  msghdr msg{};
  msg.msg_iov = parts;
  msg.msg_iovlen = 2;
  return ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) == static_cast<ssize_t>(sizeof(verdict) + text.size());
}

std::string systemError(const std::string& what, int error) {
  return what + ": " + std::strerror(error);
}

void setSocketOptions(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
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
    throw CommError(CommError::Kind::kPeer, systemError("connection to " + rankName(peer) + " failed", errno));
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
    throw CommError(CommError::Kind::kPeer, systemError("connection to " + rankName(peer) + " failed", errno));
  }

  // Writes what the socket takes of `farewell` now; the rest waits for pushFarewell().
  void sayFarewell(std::string bytes) {
    farewell = std::move(bytes);
    saidFarewell = true;
    pushFarewell();
  }

  // True once all of `farewell` is out (or the connection broke, so none of it can go).
  bool pushFarewell() {
    while (!farewell.empty()) {
      ssize_t sent = ::send(fd, farewell.data(), farewell.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent > 0) {
        farewell.erase(0, static_cast<size_t>(sent));
      } else if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        return false;
      } else {
        farewell.clear();
      }
    }
    return true;
  }

  // The last words to the peer: what was left of a frame cut off by an abort, then the fault
  // frame, or a goodbye frame.
  std::string farewell;
  bool saidFarewell = false;
};

TcpTransport::TcpTransport(int rank, int size, std::shared_ptr<Rendezvous> rendezvous, const TcpOptions& options)
    : MessageTransport(rank, size, options.messages),
      timeout_(options.timeout),
      gate_(options.secret, rank, "TCP connection"),
      addresses_(static_cast<size_t>(size)),
      pairs_(static_cast<size_t>(size)) {
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakeFd_ < 0) {
    throw std::runtime_error(systemError("torus: eventfd", errno));
  }
  try {
    if (options.listener) {
      addresses_[rank] = options.listener->address();
      listenFd_ = options.listener->release();
    } else if (size > 1) {
      listenFd_ = listenOn(options.address, size, &addresses_[rank]);
      rendezvous->set("tcp/" + std::to_string(rank), addresses_[rank]);
    }
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) {
        continue;
      }
      addPeer(peer);
      if (!rendezvous->looksUpFromAnyThread()) {
        addresses_[peer] = rendezvous->get("tcp/" + std::to_string(peer));
      }
    }
  } catch (...) {
    closeSocket(listenFd_);
    ::close(wakeFd_);
    throw;
  }
  if (rendezvous->looksUpFromAnyThread()) {
    addressLookups_ = std::make_unique<PublishedLookups>(std::move(rendezvous), [this] { wakeSleeper(); });
  }
  joinHelper();
}

TcpTransport::~TcpTransport() {
  leaveHelper();
  addressLookups_.reset(); // its thread wakes this transport's sleeper
  for (Pair* pair : linked_) {
    // Only between whole frames: a connection mid-frame just closes.
    if (peerFailure(pair->peer).empty() && betweenFrames(pair->peer)) {
      pair->sayFarewell(goodbyeFrame());
    }
  }
  if (!groupFailure().empty()) {
    // Peers whose proven hellos are in hear why; closing the listening socket would reset them
    // unanswered.
    advanceIncoming();
  }
  deliverFarewells();
  for (Pair* pair : linked_) {
    closeSocket(pair->fd);
  }
  for (auto& [peer, dial] : dials_) {
    closeSocket(dial.fd);
  }
  for (auto& incoming : incoming_) {
    closeSocket(incoming.fd);
  }
  for (int fd : halfMade_) {
    closeSocket(fd);
  }
  closeSocket(listenFd_);
  ::close(wakeFd_);
}

void TcpTransport::deliverFarewells() {
  const Deadline until = Clock::now() + kFarewellLinger;
  std::vector<pollfd> unwritten;
  while (true) {
    unwritten.clear();
    bool undelivered = false;
    // Written, not yet acknowledged by the peer's kernel, on a connection that can still deliver
    // it: a connection the peer reset (it closed first) keeps counting its unsent bytes, and
    // waiting for them cost every destroy the whole linger.
    auto queued = [](int fd) {
      tcp_info info{};
      socklen_t length = sizeof(info);
      return unacknowledged(fd) &&
             !(::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) == 0 && info.tcpi_state == TCP_CLOSE);
    };
    for (Pair* pair : linked_) {
      if (!pair->saidFarewell) {
        continue;
      }
      if (!pair->pushFarewell()) {
        unwritten.push_back({pair->fd, POLLOUT, 0});
      } else {
        undelivered |= queued(pair->fd);
      }
    }
    for (int fd : halfMade_) {
      undelivered |= queued(fd);
    }
    if ((unwritten.empty() && !undelivered) || Clock::now() >= until) {
      return;
    }
    ::poll(unwritten.data(), unwritten.size(), 1);
  }
}

void TcpTransport::wantLink(int peer) {
  if (pairs_[peer] || dials_.count(peer)) {
    return;
  }
  Dial& dial = dials_[peer];
  dial.deadline = Clock::now() + timeout_;
  advanceDial(peer, dial);
  if (progressing_) {
    wakeSleeper(); // the sleeping thread must watch the new socket
  }
}

bool TcpTransport::hasOwnWork() const {
  if (!dials_.empty() || !incoming_.empty()) {
    return true;
  }
  for (const Pair* pair : linked_) {
    if (!pair->farewell.empty()) {
      return true;
    }
  }
  // A peer waiting in the listen queue for this rank to answer its Hello.
  pollfd pfd{listenFd_, POLLIN, 0};
  return listenFd_ >= 0 && ::poll(&pfd, 1, 0) > 0;
}

bool TcpTransport::checkPeers() {
  return (!dials_.empty() || !incoming_.empty()) && advanceConnections();
}

bool TcpTransport::advanceConnections() {
  bool changed = advanceIncoming();
  for (auto it = dials_.begin(); it != dials_.end();) {
    const int peer = it->first;
    const bool linked = advanceDial(peer, it->second);
    changed |= linked || !peerFailure(peer).empty();
    if (linked || !peerFailure(peer).empty()) {
      closeSocket(linked ? -1 : it->second.fd);
      it = dials_.erase(it);
    } else {
      ++it;
    }
  }
  return changed;
}

bool TcpTransport::advanceIncoming() {
  bool linked = false;
  acceptWaiting();
  for (size_t i = 0; i < incoming_.size();) {
    Incoming& incoming = incoming_[i];
    ssize_t got = ::recv(incoming.fd, incoming.hello + incoming.helloRead, sizeof(Hello) - incoming.helloRead,
                         MSG_DONTWAIT);
    const bool broken = got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    if (got > 0) {
      incoming.helloRead += static_cast<size_t>(got);
    }
    // A socket that closes, stays silent or says nothing sensible is no peer of this group (or a
    // connection its rank gave up for ours); it is closed without a byte written to it.
    const bool done = incoming.helloRead == sizeof(Hello);
    if (broken || Clock::now() >= incoming.deadline || done) {
      if (!broken && !done) {
        gate_.turnAway(peerAddress(incoming.fd), "it sent no hello within " + std::to_string(timeout_.count()) + " ms");
      }
      linked |= done && !broken && answerHello(incoming);
      closeSocket(incoming.fd); // unless answerHello kept it
      incoming_.erase(incoming_.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    ++i;
  }
  return linked;
}

void TcpTransport::acceptWaiting() {
  while (listenFd_ >= 0) {
    const int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      return; // EAGAIN, or an error of that one connection (its peer sees it)
    }
    keepFromForkedChildren(fd);
    Incoming incoming;
    incoming.fd = fd;
    incoming.deadline = Clock::now() + timeout_;
    incoming_.push_back(incoming);
  }
}

bool TcpTransport::answerHello(Incoming& incoming) {
  Hello hello;
  std::memcpy(&hello, incoming.hello, sizeof(hello));
  const int peer = hello.rank;
  if (!hello.fits(kHelloMagic, rank(), size())) {
    gate_.turnAway(peerAddress(incoming.fd), foreignHello(hello.magic, peer, hello.size));
    return false;
  }
  if (!gate_.admits(kHelloPurpose, peer, hello.nonce, hello.proof)) {
    gate_.turnAway(peerAddress(incoming.fd), unprovenHello(peer));
    return false;
  }
  // Proven: now it may hear why this rank gave up, and waits to be closed until it has.
  const std::string& gaveUp = groupFailure();
  if (!gaveUp.empty()) {
    sendVerdict(incoming.fd, kGaveUp, gaveUp);
    halfMade_.push_back(incoming.fd);
    incoming.fd = -1;
    return false;
  }
  // Both ranks connected at once: the lower rank's connection is kept, on both sides.
  auto dial = dials_.find(peer);
  const bool dialing = dial != dials_.end() && dial->second.fd >= 0;
  if (pairs_[peer] || (dialing && rank() < peer)) {
    sendVerdict(incoming.fd, kRefused);
    return false;
  }
  if (!sendVerdict(incoming.fd, kAccepted, "", prove(gate_.secret(), kAcceptPurpose, rank(), peer, hello.nonce))) {
    return false;
  }
  if (dial != dials_.end()) {
    closeSocket(dial->second.fd);
    dials_.erase(dial);
  }
  link(peer, incoming.fd);
  incoming.fd = -1;
  return true;
}

bool TcpTransport::advanceDial(int peer, Dial& dial) {
  using Step = Dial::Step;
  const std::string where = addresses_[peer];
  const std::string cannot = "torus: rank " + std::to_string(rank()) + " cannot connect to " + rankName(peer);
  if (pairs_[peer]) {
    return true;
  }
  if (!peerFailure(peer).empty()) {
    return false;
  }
  if (dial.step == Step::kRefused && Clock::now() < dial.nextTry) {
    return false;
  }
  if (dial.step == Step::kLookUp && where.empty()) {
    std::string failure;
    auto found = addressLookups_->lookUp("tcp/" + std::to_string(peer), dial.deadline, &failure);
    if (!failure.empty()) {
      failPeer(peer, cannot + ": " + failure);
    }
    if (!found) {
      dial.nextTry = dial.deadline; // the lookup wakes the sleeper when it has an answer
      return false;
    }
    addresses_[peer] = *found;
    return advanceDial(peer, dial);
  }
  if (dial.step == Step::kLookUp || dial.step == Step::kRefused) {
    socklen_t length = 0;
    sockaddr_storage address{};
    try {
      address = parseHostPort(where, &length);
    } catch (const std::exception& e) {
      failPeer(peer, cannot + " at " + where + ": " + e.what());
      return false;
    }
    dial.fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (dial.fd < 0) {
      failPeer(peer, systemError(cannot + " at " + where, errno));
      return false;
    }
    keepFromForkedChildren(dial.fd);
    dial.step = Step::kConnect;
    dial.error = ::connect(dial.fd, reinterpret_cast<const sockaddr*>(&address), length) != 0 && errno != EINPROGRESS
                     ? errno
                     : 0;
  }
  if (dial.step == Step::kConnect) {
    int error = dial.error;
    if (error == 0) {
      pollfd pfd{dial.fd, POLLOUT, 0};
      if (::poll(&pfd, 1, 0) == 0) {
        if (Clock::now() >= dial.deadline) {
          failPeer(peer, cannot + " at " + where + ": connecting timed out");
        }
        return false;
      }
      socklen_t length = sizeof(error);
      ::getsockopt(dial.fd, SOL_SOCKET, SO_ERROR, &error, &length);
    }
    if (error == ECONNREFUSED) {
      // Its address was published after it listened: nobody listens any more.
      peerVanished(peer, systemError(cannot + " at " + where, error) + " (" + rankName(peer) +
                             " exited, was killed, or left the group: connection closed)");
      return false;
    }
    if (error != 0) {
      // The network may come back (a host rebooting, a route appearing) before the deadline.
      closeSocket(dial.fd);
      dial.fd = -1;
      if (Clock::now() >= dial.deadline) {
        failPeer(peer, systemError(cannot + " at " + where, error) + " (timed out)");
        return false;
      }
      dial.step = Step::kRefused;
      dial.nextTry = backoff(dial.tries++);
      return false;
    }
    dial.nonce = freshNonce();
    Hello hello{kHelloMagic, rank(), size(), dial.nonce,
                prove(gate_.secret(), kHelloPurpose, rank(), peer, dial.nonce)};
    if (::send(dial.fd, &hello, sizeof(hello), MSG_NOSIGNAL | MSG_DONTWAIT) != sizeof(hello)) {
      peerVanished(peer, systemError(cannot + " at " + where + ": sending its hello", errno));
      return false;
    }
    dial.step = Step::kAwaitVerdict;
    dial.verdict.clear();
  }
  if (dial.step == Step::kAwaitVerdict) {
    Verdict verdict{};
    size_t want = sizeof(Verdict);
    if (dial.verdict.size() >= sizeof(Verdict)) {
      std::memcpy(&verdict, dial.verdict.data(), sizeof(verdict));
      want += std::min<size_t>(verdict.reasonBytes, kFaultTextBytes);
    }
    char buffer[sizeof(Verdict) + kFaultTextBytes];
    ssize_t got = ::recv(dial.fd, buffer, want - dial.verdict.size(), MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (Clock::now() >= dial.deadline) {
        failPeer(peer, cannot + " at " + where + ": timed out waiting for it to accept the connection");
      }
      return false;
    }
    if (got <= 0) {
      peerVanished(peer, (got == 0 ? cannot + " at " + where + ": connection closed"
                                   : systemError(cannot + " at " + where, errno)) +
                             " during the handshake (" + rankName(peer) + " exited, was killed, or left the group)");
      return false;
    }
    dial.verdict.append(buffer, static_cast<size_t>(got));
    if (dial.verdict.size() < sizeof(Verdict)) {
      return false;
    }
    std::memcpy(&verdict, dial.verdict.data(), sizeof(verdict));
    if (verdict.code == kGaveUp) {
      if (dial.verdict.size() < sizeof(Verdict) + std::min<size_t>(verdict.reasonBytes, kFaultTextBytes)) {
        return advanceDial(peer, dial); // the rest of the reason may be waiting already
      }
      failPeer(peer, rankName(peer) + " gave up on the group: " + dial.verdict.substr(sizeof(Verdict)));
      return false;
    }
    if (verdict.code == kAccepted &&
        !sameDigest(verdict.proof, prove(gate_.secret(), kAcceptPurpose, peer, rank(), dial.nonce))) {
      gate_.turnAway(where, "its acceptance of this rank's hello to " + rankName(peer) + " has a wrong proof");
      failPeer(peer, cannot + " at " + where + ": the process listening there did not prove it belongs to the group");
      return false;
    }
    if (verdict.code == kAccepted) {
      link(peer, dial.fd);
      dial.fd = -1;
      return true;
    }
    // The peer keeps its own connection to this rank, which is on its way.
    closeSocket(dial.fd);
    dial.fd = -1;
    dial.step = Step::kRefused;
    dial.nextTry = Clock::now() + kRetryAfterRefusal;
  }
  return false;
}

void TcpTransport::link(int peer, int fd) {
  setSocketOptions(fd);
  pairs_[peer] = std::make_unique<Pair>();
  pairs_[peer]->peer = peer;
  pairs_[peer]->fd = fd;
  linked_.push_back(pairs_[peer].get());
  attach(peer, pairs_[peer].get());
  if (!abortReason().empty()) { // connected after announceAbort: told now
    pairs_[peer]->sayFarewell(faultFrame(abortReason()));
  }
}

void TcpTransport::announceAbort(const std::string& why) {
  // Peers that connect from now on are told why (groupFailure()), until the group is destroyed.
  // A connected peer gets the rest of any frame cut off partly written, so that it reads the
  // fault frame as one, then the reason; what the socket does not take now goes out when more
  // progress is made or when the transport is destroyed (deliverFarewells).
  for (Pair* pair : linked_) {
    if (canTell(pair->peer)) {
      pair->sayFarewell(restOfFrame(pair->peer) + faultFrame(why));
    }
  }
  // Dials are told too, then only wait to be closed. A dial that sent its Hello may already be a
  // link on the peer's side (its verdict on the way), so a fault frame follows the Hello; it fits
  // in a new socket's buffer. An accepted socket hears why once its hello proves it comes from a
  // peer (answerHello): nothing is written to a connection before that.
  const std::string fault = faultFrame(why);
  for (auto& [peer, dial] : dials_) {
    if (dial.fd >= 0) {
      if (dial.step == Dial::Step::kAwaitVerdict) {
        ssize_t ignored = ::send(dial.fd, fault.data(), fault.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)ignored;
      }
      halfMade_.push_back(dial.fd);
    }
  }
  dials_.clear();
}

void TcpTransport::wakeSleeper() {
  uint64_t one = 1;
  ssize_t ignored = ::write(wakeFd_, &one, sizeof(one));
  (void)ignored;
}

bool TcpTransport::sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) {
  std::vector<pollfd> fds;
  std::vector<int> polled;
  fds.reserve(linked_.size() + incoming_.size() + dials_.size() + 2);
  fds.push_back({wakeFd_, POLLIN, 0});
  // Connections being made wake the sleep through the listening socket, their own sockets, or
  // the time of their next try.
  Clock::time_point wakeAt = deadline;
  if (listenFd_ >= 0) {
    fds.push_back({listenFd_, POLLIN, 0});
  }
  for (const auto& incoming : incoming_) {
    fds.push_back({incoming.fd, POLLIN, 0});
  }
  for (const auto& [peer, dial] : dials_) {
    if (dial.fd >= 0) {
      fds.push_back({dial.fd, static_cast<short>(dial.step == Dial::Step::kConnect ? POLLOUT : POLLIN), 0});
    } else {
      wakeAt = std::min(wakeAt, dial.nextTry);
    }
  }
  const size_t connectionFds = fds.size();
  for (Pair* pair : linked_) {
    if (peerFailure(pair->peer).empty()) {
      fds.push_back({pair->fd, static_cast<short>(POLLIN | (wantsToWrite(pair->peer) ? POLLOUT : 0)), 0});
      polled.push_back(pair->peer);
    }
  }
  const size_t pairFds = fds.size();
  for (Pair* pair : linked_) {
    if (!pair->pushFarewell()) {
      fds.push_back({pair->fd, POLLOUT, 0});
    }
  }
  lock.unlock();
  int ready = ::poll(fds.data(), fds.size(), millisecondsUntil(wakeAt, kIdleCheckMs));
  lock.lock();
  if (ready < 0) {
    return true;
  }
  if (fds[0].revents) {
    uint64_t drained;
    ssize_t ignored = ::read(wakeFd_, &drained, sizeof(drained));
    (void)ignored;
  }
  bool connecting = wakeAt < deadline && Clock::now() >= wakeAt;
  for (size_t i = 1; i < connectionFds; ++i) {
    connecting |= fds[i].revents != 0;
  }
  bool moved = connecting && advanceConnections();
  for (size_t i = connectionFds; i < pairFds; ++i) {
    if (fds[i].revents) {
      moved |= tryPeer(polled[i - connectionFds]);
    }
  }
  return ready > 0 || moved;
}

} // namespace torus
