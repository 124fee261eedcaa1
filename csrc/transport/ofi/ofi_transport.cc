// OfiTransport: the fabric, the peers' lookups, hellos and streams made, the completion queue read
// and dispatched, the lifelines watched, the sleep, and farewells when the group ends. The stream
// to each peer is in ofi_stream.cc.
#include "transport/ofi/ofi_transport.h"

#include <poll.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_tagged.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "transport/ofi/ofi_stream.h"
#include "transport/ofi/ofi_transport_impl.h"

namespace torus {

namespace {

// Providers without a wait descriptor are looked at this often while the thread sleeps.
constexpr auto kPolledSleep = std::chrono::microseconds(200);
// Lifelines are looked at no more often than this while threads spin.
constexpr auto kLifelineCheck = std::chrono::milliseconds(1);
// Messages above this go by RMA reads by default, where the provider reads in hardware.
constexpr size_t kDefaultRmaAbove = 256 * 1024;
// A read the provider could not take (-FI_EAGAIN) is tried again this soon while threads sleep.
constexpr auto kReadRetry = std::chrono::milliseconds(1);

std::string toHex(const std::string& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string text;
  for (unsigned char c : bytes) {
    text += digits[c >> 4];
    text += digits[c & 15];
  }
  return text;
}

// Whether process `pid` is gone (a zombie counts: it runs no more).
bool processGone(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) {
    return true;
  }
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] == 'Z' || line[close + 2] == 'X';
}

std::string fromHex(const std::string& text) {
  std::string bytes;
  for (size_t i = 0; i + 1 < text.size(); i += 2) {
    bytes += static_cast<char>(std::stoi(text.substr(i, 2), nullptr, 16));
  }
  return bytes;
}

} // namespace

OfiTransport::OfiTransport(int rank, int size, std::shared_ptr<Rendezvous> rendezvous, const OfiOptions& options)
    : MessageTransport(rank, size, options.messages),
      fabric_(options.provider, options.address),
      lifelines_(options.address, rank, size, options.secret, options.timeout),
      gate_(options.secret, rank, "fabric hello"),
      rmaAbove_(options.rmaAbove ? *options.rmaAbove
                                 : fabric_.rmaOverSockets() ? SIZE_MAX : kDefaultRmaAbove),
      timeout_(options.timeout),
      published_(static_cast<size_t>(size)),
      streams_(static_cast<size_t>(size)),
      hellos_(kHelloSlots),
      helloPosts_(kHelloSlots) {
  if (fabric_.maxMessageBytes() < kChunkBytes) {
    throw std::runtime_error("torus: libfabric provider " + std::string(fabric_.providerName()) + " sends at most " +
                             std::to_string(fabric_.maxMessageBytes()) + " bytes per message, less than the " +
                             std::to_string(kChunkBytes) + " of the OFI transport's chunks (TORUS_OFI_PROVIDER)");
  }
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakeFd_ < 0) {
    throw std::runtime_error(std::string("torus: eventfd: ") + std::strerror(errno));
  }
  std::string why;
  if (fabric_.registersLocal() &&
      !fabric_.registerMemory(hellos_.data(), hellos_.size() * sizeof(HelloMessage), FI_RECV, &helloRegion_, &why)) {
    ::close(wakeFd_);
    throw std::runtime_error("torus: " + why);
  }
  for (int i = 0; i < kHelloSlots; ++i) {
    postHello(i);
  }
  rendezvous->set("ofi/" + std::to_string(rank), lifelines_.where() + " " + toHex(fabric_.name()));
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) {
      continue;
    }
    addPeer(peer);
    if (!rendezvous->looksUpFromAnyThread()) {
      published_[peer] = rendezvous->get("ofi/" + std::to_string(peer));
    }
  }
  if (rendezvous->looksUpFromAnyThread()) {
    addressLookups_ = std::make_unique<PublishedLookups>(std::move(rendezvous), [this] { wakeSleeper(); });
  }
  joinHelper();
}

OfiTransport::~OfiTransport() {
  leaveHelper();
  addressLookups_.reset(); // its thread wakes this transport's sleeper
  std::unique_lock<std::mutex> lock(mutex_);
  destroying_ = true;
  for (Stream* stream : made_) {
    if (peerFailure(stream->peer).empty() && betweenFrames(stream->peer)) {
      stream->farewell += goodbyeFrame();
    }
  }
  // A goodbye's text says how this rank leaves (departure.h); a fault's, why it gave up.
  sayFarewells(groupFailure().empty() ? ofi::Farewell::kGoodbye : ofi::Farewell::kFault,
               groupFailure().empty() ? ofi::goodbyeWhy(currentDeparture()) : groupFailure());
  const Deadline until = Clock::now() + kFarewellLinger;
  for (bool drained = false; !drained && Clock::now() < until;) {
    pump();
    checkLifelines(false); // a peer that is gone takes nothing more
    drained = true;
    for (Stream* stream : made_) {
      drained &= !stream->sending() || lifelines_.ended(stream->peer);
    }
    if (!drained) {
      sched_yield();
    }
  }
  lifelines_.closeAll(std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max<Clock::duration>(Clock::duration::zero(), until - Clock::now())));
  clearDeadSegments();
  // The endpoint closes before the memory its receives were posted into is freed.
  for (Stream* stream : made_) {
    stream->release();
  }
  fabric_.deregister(helloRegion_);
  fabric_.close();
  ::close(wakeFd_);
}

void OfiTransport::postHello(int slot) {
  ofi::Posted& posted = helloPosts_[slot];
  posted.owner = this;
  posted.kind = kHelloReceive;
  posted.index = slot;
  const ssize_t result = fi_trecv(fabric_.endpoint(), &hellos_[slot], sizeof(HelloMessage), helloRegion_.desc,
                                  FI_ADDR_UNSPEC, kHelloTag, kRankBits, &posted);
  if (result != 0) {
    hellosToPost_.push_back(slot);
  }
}

void OfiTransport::makeStream(int peer, const std::string& name, const std::string& lifeline, bool dialed) {
  auto stream = std::make_unique<Stream>();
  stream->transport = this;
  stream->peer = peer;
  stream->address = fabric_.insert(name);
  stream->name = name;
  stream->memory.reset(new char[Stream::kMemoryBytes]);
  std::string why;
  if (fabric_.registersLocal() &&
      !fabric_.registerMemory(stream->memory.get(), Stream::kMemoryBytes, FI_SEND | FI_RECV, &stream->region, &why)) {
    failPeer(peer, "torus: cannot reach " + rankName(peer) + " over libfabric: " + why);
    return;
  }
  stream->desc = stream->region.desc;
  for (int i = 0; i < kSlots; ++i) {
    stream->slotPosts[i] = ofi::Posted{{}, stream.get(), kSlotReceive, i};
    stream->chunkPosts[i] = ofi::Posted{{}, stream.get(), kChunkSend, i};
    stream->toRepost.push_back(i);
  }
  stream->controlReceivePost = ofi::Posted{{}, stream.get(), kControlReceive, 0};
  stream->controlSendPost = ofi::Posted{{}, stream.get(), kControlSend, 0};
  stream->helloPost = ofi::Posted{{}, stream.get(), kHelloSend, 0};
  if (dialed) {
    HelloMessage& hello = stream->hello();
    hello = HelloMessage{};
    hello.rank = rank();
    hello.size = size();
    const std::string& name = fabric_.name();
    hello.nameBytes = static_cast<uint32_t>(std::min(name.size(), sizeof(hello.name)));
    std::memcpy(hello.name, name.data(), hello.nameBytes);
    hello.nonce = freshNonce();
    hello.proof =
        prove(gate_.secret(), kHelloPurpose, rank(), peer, hello.nonce, std::string(hello.name, hello.nameBytes));
    stream->helloToSend = true;
    lifelines_.dial(peer, lifeline);
  }
  if (!groupFailure().empty()) { // a peer that comes after the group failed is told why
    stream->farewell = faultFrame(groupFailure());
  }
  stream->pump();
  Stream* made = stream.get();
  streams_[peer] = std::move(stream);
  made_.push_back(made);
  attach(peer, made);
}

void OfiTransport::onHello(const HelloMessage& hello, size_t bytes) {
  if (bytes != sizeof(HelloMessage)) { // the rest of the slot holds an earlier hello's bytes
    gate_.turnAway("a fabric endpoint", "its hello is " + std::to_string(bytes) + " bytes, not " +
                                            std::to_string(sizeof(HelloMessage)));
    return;
  }
  const int peer = hello.rank;
  if (hello.magic != kHelloMagic || hello.size != size() || peer < 0 || peer >= size() || peer == rank() ||
      hello.nameBytes > sizeof(hello.name)) {
    gate_.turnAway("a fabric endpoint", foreignHello(hello.magic, peer, hello.size));
    return;
  }
  const std::string name(hello.name, hello.nameBytes);
  if (!gate_.admits(kHelloPurpose, peer, hello.nonce, hello.proof, name)) {
    gate_.turnAway("the fabric endpoint " + toHex(name), unprovenHello(peer));
    return;
  }
  if (streams_[peer]) {
    heardFrom(*streams_[peer]);
    return;
  }
  // A peer that says hello after the group failed gets a stream all the same: it carries why.
  lookups_.erase(peer);
  try {
    makeStream(peer, name, "", false);
    if (streams_[peer]) {
      heardFrom(*streams_[peer]);
    }
  } catch (const std::exception& e) {
    failPeer(peer, std::string("torus: cannot reach ") + rankName(peer) + ": " + e.what());
  }
}

void OfiTransport::wantLink(int peer) {
  if (streams_[peer] || lookups_.count(peer)) {
    return;
  }
  Lookup& lookup = lookups_[peer];
  lookup.deadline = Clock::now() + timeout_;
  if (advanceLookup(peer, lookup)) {
    lookups_.erase(peer);
  }
  if (progressing_) {
    wakeSleeper();
  }
}

bool OfiTransport::advanceLookup(int peer, Lookup& lookup) {
  const std::string cannot = "torus: rank " + std::to_string(rank()) + " cannot reach " + rankName(peer);
  if (streams_[peer] || !peerFailure(peer).empty()) {
    return true;
  }
  if (published_[peer].empty()) {
    std::string failure;
    auto found = addressLookups_->lookUp("ofi/" + std::to_string(peer), lookup.deadline, &failure);
    if (!failure.empty()) {
      failPeer(peer, cannot + ": " + failure);
      return true;
    }
    if (!found) {
      return false; // the lookup wakes the sleeper when it has an answer
    }
    published_[peer] = *found;
  }
  const std::string& published = published_[peer];
  const auto space = published.find(' ');
  try {
    if (space == std::string::npos) {
      throw std::runtime_error("its published address '" + published + "' is not an OFI one");
    }
    makeStream(peer, fromHex(published.substr(space + 1)), published.substr(0, space), true);
  } catch (const std::exception& e) {
    failPeer(peer, cannot + " over libfabric: " + e.what());
  }
  return true;
}

bool OfiTransport::hasOwnWork() const {
  if (!lookups_.empty() || !hellosToPost_.empty() || lifelines_.peerWaiting()) {
    return true;
  }
  for (const Stream* stream : made_) {
    if (stream->sending()) {
      return true;
    }
  }
  return false;
}

void OfiTransport::completed(ofi::Posted* posted, size_t bytes) {
  if (posted == nullptr) {
    return;
  }
  if (posted->kind == kHelloReceive) {
    onHello(hellos_[posted->index], bytes);
    postHello(posted->index);
    return;
  }
  if (posted->kind == kRead) {
    auto* read = static_cast<Stream::Read*>(posted->owner);
    read->stream->finishRead(read, 1, "");
    return;
  }
  auto* stream = static_cast<Stream*>(posted->owner);
  switch (posted->kind) {
    case kSlotReceive:
      stream->filled[posted->index] = true;
      stream->slotBytes[posted->index] = bytes;
      heardFrom(*stream);
      break;
    case kChunkSend:
      stream->sent(posted->index);
      break;
    case kControlReceive: {
      heardFrom(*stream);
      // Credits come back only for slots this rank's chunks used.
      const uint64_t returned = stream->creditWords()[0];
      const int outstanding = kSlots - stream->credits;
      stream->controlReceivePosted = false;
      if (bytes != sizeof(uint64_t) || returned > static_cast<uint64_t>(outstanding)) {
        stream->brokeProtocol(bytes != sizeof(uint64_t)
                                  ? "a credit message of " + std::to_string(bytes) + " bytes"
                                  : "a credit of " + std::to_string(returned) + " slots, where " +
                                        std::to_string(outstanding) + " were outstanding");
        break;
      }
      stream->credits += static_cast<int>(returned);
      stream->postControlReceive();
      stream->postChunks();
      break;
    }
    case kControlSend:
      stream->controlSendBusy = false;
      break;
    case kHelloSend:
      stream->helloBusy = false;
      break;
  }
}

void OfiTransport::failed(ofi::Posted* posted, const std::string& why) {
  if (posted == nullptr || destroying_) {
    return;
  }
  if (posted->kind == kHelloReceive) {
    hellosToPost_.push_back(posted->index);
    return;
  }
  if (posted->kind == kRead) {
    auto* read = static_cast<Stream::Read*>(posted->owner);
    read->stream->finishRead(read, -1, why);
    return;
  }
  auto* stream = static_cast<Stream*>(posted->owner);
  if (stream->error.empty()) {
    stream->error = "libfabric: an operation with " + rankName(stream->peer) + " failed: " + why;
  }
}

bool OfiTransport::pump() {
  bool moved = false;
  while (fabric_.readCompletions(
             16, [this](ofi::Posted* posted, size_t bytes) { completed(posted, bytes); },
             [this](ofi::Posted* posted, const std::string& why) { failed(posted, why); }) > 0) {
    moved = true;
  }
  for (size_t i = hellosToPost_.size(); i-- > 0;) {
    const int slot = hellosToPost_[i];
    hellosToPost_.erase(hellosToPost_.begin() + static_cast<std::ptrdiff_t>(i));
    postHello(slot);
  }
  for (Stream* stream : made_) {
    if (!stream->gone()) {
      moved |= stream->pump();
    }
  }
  return moved;
}

bool OfiTransport::checkLifelines(bool now) {
  if (!now && Clock::now() < nextLifelineCheck_) {
    return false;
  }
  nextLifelineCheck_ = Clock::now() + kLifelineCheck;
  const bool ended = lifelines_.check();
  for (Stream* stream : made_) {
    stream->checkFarewell();
  }
  if (ended || deadSegments_) {
    clearDeadSegments();
  }
  return ended;
}

void OfiTransport::heardFrom(Stream& stream) {
  if (stream.heard) {
    return;
  }
  stream.heard = true;
  if (++heardFrom_ == size() - 1) {
    fabric_.unlinkSegment(fabric_.name());
  }
}

void OfiTransport::clearDeadSegments() {
  deadSegments_ = false;
  for (Stream* stream : made_) {
    if (stream->segmentCleared || !lifelines_.ended(stream->peer) || lifelines_.farewell(stream->peer)) {
      continue;
    }
    const int pid = ofi::Fabric::segmentOwner(stream->name);
    if (pid <= 0) {
      stream->segmentCleared = true;
    } else if (processGone(pid)) {
      stream->segmentCleared = true;
      fabric_.unlinkSegment(stream->name);
    } else {
      deadSegments_ = true; // its sockets close before the process is gone: looked at again
    }
  }
}

bool OfiTransport::advanceLookups() {
  bool moved = false;
  for (auto it = lookups_.begin(); it != lookups_.end();) {
    if (advanceLookup(it->first, it->second)) {
      moved = true;
      it = lookups_.erase(it);
    } else {
      ++it;
    }
  }
  return moved;
}

bool OfiTransport::checkPeers() {
  bool moved = pump();
  moved |= advanceLookups();
  return checkLifelines(false) || moved;
}

void OfiTransport::announceAbort(const std::string& why) {
  // A peer reads the rest of any frame cut off partly written, then the fault frame; its
  // lifeline says how many bytes that makes, and why, in case the stream cannot deliver them.
  for (Stream* stream : made_) {
    if (canTell(stream->peer)) {
      stream->farewell += restOfFrame(stream->peer) + faultFrame(why);
      stream->pump();
    }
  }
  sayFarewells(ofi::Farewell::kFault, why);
}

void OfiTransport::sayFarewells(ofi::Farewell::Kind kind, const std::string& why) {
  // Every peer, also one this rank never talked to: it may be dialing now, waiting for it.
  for (int peer = 0; peer < size(); ++peer) {
    if (peer != rank()) {
      const Stream* stream = streams_[peer].get();
      lifelines_.sayFarewell(peer, ofi::Farewell{kind, stream ? stream->written + stream->farewell.size() : 0,
                                                 stream ? stream->readBytes : 0, why});
    }
  }
}

void OfiTransport::wakeSleeper() {
  uint64_t one = 1;
  ssize_t ignored = ::write(wakeFd_, &one, sizeof(one));
  (void)ignored;
}

bool OfiTransport::sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) {
  if (pump()) {
    return true;
  }
  std::vector<pollfd> fds;
  fds.push_back({wakeFd_, POLLIN, 0});
  int timeoutMs;
  if (fabric_.waitFd() >= 0) {
    if (!fabric_.mayBlock()) {
      return true; // completions arrived since the pump
    }
    fds.push_back({fabric_.waitFd(), POLLIN, 0});
    Clock::time_point wakeAt = deadline;
    for (const auto& [peer, lookup] : lookups_) {
      wakeAt = std::min(wakeAt, lookup.deadline);
    }
    for (const Stream* stream : made_) {
      if (stream->reading && !stream->reading->posted) {
        wakeAt = std::min(wakeAt, Clock::now() + kReadRetry); // the provider asked to try again
      }
    }
    timeoutMs = millisecondsUntil(wakeAt, kIdleCheckMs);
  } else {
    timeoutMs = 0;
  }
  lifelines_.watch(fds);
  lock.unlock();
  int ready;
  if (timeoutMs == 0 && fabric_.waitFd() < 0) {
    const timespec pause{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kPolledSleep).count()};
    ready = ::ppoll(fds.data(), fds.size(), &pause, nullptr);
  } else {
    ready = ::poll(fds.data(), fds.size(), timeoutMs);
  }
  lock.lock();
  if (fds[0].revents) {
    uint64_t drained;
    ssize_t ignored = ::read(wakeFd_, &drained, sizeof(drained));
    (void)ignored;
  }
  // The lifelines now (checkPeers looks at them only every kLifelineCheck), then what checkPeers does.
  bool moved = checkLifelines(true);
  moved |= checkPeers();
  if (ready > 0 || moved) {
    return true;
  }
  // A polled provider wakes every kPolledSleep: the idle checks still run every kIdleCheckMs.
  if (Clock::now() - lastIdle_ < std::chrono::milliseconds(kIdleCheckMs)) {
    return true;
  }
  lastIdle_ = Clock::now();
  return false;
}

bool ofiBuilt() {
  return true;
}

std::unique_ptr<MessageTransport> makeOfiTransport(int rank, int size, std::shared_ptr<Rendezvous> rendezvous,
                                                   const OfiOptions& options, std::string* description) {
  auto transport = std::make_unique<OfiTransport>(rank, size, std::move(rendezvous), options);
  *description = "ofi: " + transport->description();
  return transport;
}

} // namespace torus
