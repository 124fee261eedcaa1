#include "transport/ofi/ofi_transport.h"

#include <poll.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <fstream>
#include <optional>
#include <unordered_map>

#include "transport/group_secret.h"
#include "transport/ofi/fabric.h"
#include "transport/ofi/lifelines.h"

namespace torus {

namespace {

// A stream's chunk and receive slot: 32 KiB, within the eager size the fabric is opened with
// (Fabric raises rxm's from 16 KiB), so that no chunk waits for rxm's rendezvous. At 10 Gbit/s
// on the emulated cluster 32 KiB chunks carried 98-103% of torus TCP's busbw from 1 MiB up, 16
// KiB ones 68-92% and 64 KiB ones 80-97%; above the eager size, 128 KiB chunks fell to 0.074 GB/s
// on the 1 Gbit/s link (BENCHMARKS.md). kSlots of them per peer each way bound what waits for a
// rank that does not read, and keep 1 MiB in flight.
constexpr size_t kChunkBytes = ofi::Fabric::kEagerBytes;
constexpr int kSlots = 32;
// Credits go back once this many slots are free again: often enough that a sender never waits
// while the receiver reads, rarely enough that small messages are not answered one by one.
constexpr int kCreditBatch = kSlots / 2;
constexpr int kHelloSlots = 8;
// Tags: the kind of message in the top bits, the sender's rank below.
constexpr uint64_t kStreamTag = uint64_t{1} << 60;
constexpr uint64_t kControlTag = uint64_t{2} << 60;
constexpr uint64_t kHelloTag = uint64_t{3} << 60;
constexpr uint64_t kRankBits = (uint64_t{1} << 60) - 1;
// A sleep with nothing to do ends after this to run the message layer's idle checks.
constexpr int kIdleCheckMs = 100;
// Providers without a wait descriptor are looked at this often while the thread sleeps.
constexpr auto kPolledSleep = std::chrono::microseconds(200);
// Lifelines are looked at no more often than this while threads spin.
constexpr auto kLifelineCheck = std::chrono::milliseconds(1);
// Destroying a transport waits this long at most for its last chunks and farewells to go out.
constexpr auto kFarewellLinger = std::chrono::seconds(1);
// After a peer's farewell, the rest of its stream may still be on the way for this long.
constexpr auto kStreamEndGrace = std::chrono::seconds(2);
// After an operation with a peer failed, or its lifeline closed without a farewell, the lifeline
// or the stream may still say why for this long.
constexpr auto kFarewellGrace = std::chrono::milliseconds(500);
// Messages above this go by RMA reads by default, where the provider reads in hardware.
constexpr size_t kDefaultRmaAbove = 256 * 1024;
// An RMA read lands in memory of the stream's own, this much at a time, and is copied from there
// into the receive's buffer: a read given up on (its peer died, the group aborted, its deadline
// passed) may still land later, and must never land in a buffer its failed receive gave back.
constexpr size_t kReadPieceBytes = 4 << 20;
// A read the provider could not take (-FI_EAGAIN) is tried again this soon while threads sleep.
constexpr auto kReadRetry = std::chrono::milliseconds(1);

enum PostKind : int { kSlotReceive = 1, kChunkSend, kControlReceive, kControlSend, kHelloReceive, kHelloSend, kRead };

constexpr uint32_t kHelloMagic = 0x6f666921; // "ofi!"
// What a hello's proof is over (group_secret.h), with the endpoint name it carries: a hello cannot
// point a rank at an endpoint of someone else's choosing.
const char* const kHelloPurpose = "torus fabric hello";
struct HelloMessage {
  uint32_t magic = kHelloMagic;
  int32_t rank = 0;
  int32_t size = 0;
  uint32_t nameBytes = 0;
  char name[240] = {};
  Nonce nonce = {};
  Digest proof = {}; // prove(kHelloPurpose, rank, the rank told, nonce, the name)
};

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

class OfiTransport : public MessageTransport {
 public:
  OfiTransport(int rank, int size, std::shared_ptr<Rendezvous> rendezvous, const OfiOptions& options);
  ~OfiTransport() override;

  std::string description() const {
    return fabric_.describe() + (fabric_.offersRma() && rmaAbove_ != SIZE_MAX
                                     ? ", RMA reads above " + std::to_string(rmaAbove_) + " B"
                                     : ", no RMA reads");
  }

  struct Stream;

 private:
  // A peer whose address is being looked up.
  struct Lookup {
    Deadline deadline;
    Clock::time_point nextTry;
    int tries = 0;
  };

  void wantLink(int peer) override;
  bool hasOwnWork() const override;
  bool checkPeers() override;
  bool sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) override;
  void wakeSleeper() override;
  void announceAbort(const std::string& why) override;
  void abortRequested() override {
    aborting_ = true;
  }
  bool readsCheaply() const override {
    return true;
  }

  // Reads the completion queue and moves what waits in the streams (chunks waiting for credits,
  // slots to repost, credits to return, farewells); true when something moved.
  bool pump();
  void completed(ofi::Posted* posted, size_t bytes);
  void failed(ofi::Posted* posted, const std::string& why);
  // One step of a lookup; true when the peer got its stream (or failed).
  bool advanceLookup(int peer, Lookup& lookup);
  // One step of every lookup; true when one ended.
  bool advanceLookups();
  // The stream to `peer`, whose endpoint is `name`, made and attached; `dialed`: this rank asked
  // for it (it says hello and dials the lifeline), else the peer did. Throws std::runtime_error
  // when the address vector refuses the name.
  void makeStream(int peer, const std::string& name, const std::string& lifeline, bool dialed);
  // The peer sent this rank something over the fabric: with the shm provider, it has mapped this
  // endpoint's segment. Once every peer has, the segment's name goes (nothing is left in
  // /dev/shm if this process is killed).
  void heardFrom(Stream& stream);
  // With the shm provider: removes the segment of each peer whose lifeline ended without a
  // farewell and whose process is gone (killed: nothing else would).
  void clearDeadSegments();
  void postHello(int slot);
  void onHello(const HelloMessage& hello);
  // Looks at the lifelines (at most every kLifelineCheck unless `now`); true when a peer ended.
  bool checkLifelines(bool now);
  // This rank's farewell (the bytes of each stream, `why`) on every lifeline, now and later.
  void sayFarewells(ofi::Farewell::Kind kind, const std::string& why);

  ofi::Fabric fabric_;
  ofi::Lifelines lifelines_;
  Gatekeeper gate_;
  const size_t rmaAbove_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<Rendezvous> rendezvous_; // set while peers' addresses are looked up lazily
  std::vector<std::string> published_; // by rank: "<lifeline> <endpoint name in hex>", once known
  std::vector<std::unique_ptr<Stream>> streams_; // by rank; null until made
  std::vector<Stream*> made_; // the streams, in the order they were made
  std::unordered_map<int, Lookup> lookups_;
  // Hellos from peers that make their stream first.
  std::vector<HelloMessage> hellos_;
  std::vector<ofi::Posted> helloPosts_;
  std::vector<int> hellosToPost_;
  ofi::Region helloRegion_;
  int wakeFd_ = -1;
  Clock::time_point nextLifelineCheck_;
  Clock::time_point lastIdle_ = Clock::now();
  bool destroying_ = false;
  std::atomic<bool> aborting_{false}; // abort() was called: set before it takes the lock
  int heardFrom_ = 0; // peers that sent this rank something over the fabric
  bool deadSegments_ = false; // a dead peer's segment waits for its process to be gone
};

// The Link to one peer: a stream of chunks each way (see the header).
struct OfiTransport::Stream : Link {
  enum class Chunk { kFree, kFilling, kSealed, kPosted };

  // One RMA read of the peer's memory into memory of the stream's own. Lives until its completion
  // arrives or the endpoint closes, also when given up on, so that a late completion finds it
  // (and completes no later read).
  struct Read {
    ofi::Posted post;
    Stream* stream = nullptr;
    int state = 0; // 1: done, -1: failed (error says why)
    std::string error;
    bool abandoned = false;
    std::unique_ptr<char[]> memory;
    size_t capacity = 0;
    ofi::Region region;
  };

  OfiTransport* transport = nullptr;
  int peer = -1;
  fi_addr_t address = FI_ADDR_UNSPEC;
  std::string name; // the peer's endpoint
  bool heard = false; // the peer sent something over the fabric
  bool segmentCleared = false; // its shm segment removed after it died
  // Receive slots, then send chunks, then the credit words: one allocation, registered at once
  // where the provider needs local memory registered.
  std::unique_ptr<char[]> memory;
  ofi::Region region;
  void* desc = nullptr;

  ofi::Posted slotPosts[kSlots];
  bool filled[kSlots] = {};
  size_t slotBytes[kSlots] = {};
  int head = 0; // the slot read next
  size_t headRead = 0;
  std::deque<int> toRepost; // slots to post, in order: first all of them, then those consumed
  int firstPosts = kSlots; // of toRepost, the slots never posted (no credit is owed for them)
  int owed = 0; // slots freed and reposted whose credit the peer has not been given

  ofi::Posted chunkPosts[kSlots];
  Chunk chunks[kSlots] = {};
  size_t chunkBytes[kSlots] = {};
  int fill = 0; // the chunk filled next
  std::deque<int> sealed; // chunks waiting for a credit, in order
  int credits = kSlots;
  uint64_t chunkEnd[kSlots] = {}; // the stream offset after each sealed chunk's last byte
  // Posted chunks in order; a chunk whose send completed before an older one's stays posted
  // (sendDone) until the older ones complete, so the bytes handed on are always a prefix.
  std::deque<int> inFlight;
  bool sendDone[kSlots] = {};
  uint64_t handedOn = 0; // bytes of the chunks whose sends completed, in order
  uint64_t postedBytes = 0; // the stream's offset after the last chunk posted: what the peer may read

  ofi::Posted controlReceivePost;
  bool controlReceivePosted = false;
  ofi::Posted controlSendPost;
  bool controlSendBusy = false;
  uint64_t creditsToSend = 0;

  ofi::Posted helloPost;
  bool helloToSend = false;
  bool helloBusy = false;

  uint64_t written = 0; // bytes accepted onto the stream, in all
  uint64_t readBytes = 0;
  std::string farewell; // the transport's own last bytes (fault or goodbye frames), not yet taken
  std::string error; // a failed operation with this peer
  bool lied = false; // error: the peer sent what the protocol never sends
  bool farewellChecked = false;
  Clock::time_point errorSeen{};
  Clock::time_point endSeen{}; // when the peer's farewell was seen with bytes still to come
  std::unordered_map<uint64_t, ofi::Region> loans; // lent memory, by key

  char* slot(int i) {
    return memory.get() + static_cast<size_t>(i) * kChunkBytes;
  }
  char* chunk(int i) {
    return memory.get() + static_cast<size_t>(kSlots + i) * kChunkBytes;
  }
  uint64_t* creditWords() {
    return reinterpret_cast<uint64_t*>(memory.get() + 2 * kSlots * kChunkBytes);
  }
  HelloMessage& hello() {
    return *reinterpret_cast<HelloMessage*>(memory.get() + 2 * kSlots * kChunkBytes + 2 * sizeof(uint64_t));
  }
  static constexpr size_t kMemoryBytes = 2 * kSlots * kChunkBytes + 2 * sizeof(uint64_t) + sizeof(HelloMessage);

  fid_ep* ep() const {
    return transport->fabric_.endpoint();
  }
  uint64_t ownTag(uint64_t kind) const {
    return kind | static_cast<uint64_t>(transport->rank());
  }

  // Before the endpoint closes: no memory of the stream's stays registered.
  void release() {
    for (auto& [key, loan] : loans) {
      transport->fabric_.deregister(loan);
    }
    loans.clear();
    if (reader) {
      transport->fabric_.deregister(reader->region);
    }
    for (auto& read : abandoned) {
      transport->fabric_.deregister(read->region);
    }
    transport->fabric_.deregister(region);
  }

  // The peer's lifeline ended: nothing more is posted to it (a send to a dead peer may never
  // return to the shm provider, and no peer that ended reads any more).
  bool gone() const {
    return transport->lifelines_.ended(peer);
  }

  // The peer sent `what`, which the protocol never sends (a corrupt or forged word): nothing
  // more is posted to it, and its Link fails at once, naming it and the field.
  void brokeProtocol(const std::string& what) {
    if (!lied) {
      lied = true;
      error = rankName(peer) + " broke the OFI transport's protocol: it sent " + what +
              "; this rank reads nothing more from it";
    }
  }

  // The peer's farewell, once it came: the counts it gives must fit what this rank sent and read.
  void checkFarewell() {
    const auto& farewell = transport->lifelines_.farewell(peer);
    if (!farewell || farewellChecked) {
      return;
    }
    farewellChecked = true;
    if (farewell->readBytes > postedBytes) {
      brokeProtocol("a farewell whose read count says it read " + std::to_string(farewell->readBytes) +
                    " bytes of this rank's stream, where " + std::to_string(postedBytes) + " were sent");
    } else if (farewell->streamBytes < readBytes) {
      brokeProtocol("a farewell whose stream count says it wrote " + std::to_string(farewell->streamBytes) +
                    " bytes, where this rank read " + std::to_string(readBytes));
    }
  }

  void broke(const std::string& what, ssize_t result) {
    if (error.empty()) {
      error = "libfabric: " + what + " with " + rankName(peer) + " failed: " + ofi::errorText(static_cast<int>(-result));
    }
  }

  // Whether a post was taken: false when the provider is full for now (-FI_EAGAIN, tried again
  // later) or the post failed (the stream then broke, naming `what`).
  bool taken(ssize_t result, const char* what) {
    if (result != 0 && result != -FI_EAGAIN) {
      broke(what, result);
    }
    return result == 0;
  }

  // Takes what fits of `n` bytes into chunks; returns how many.
  size_t accept(const char* data, size_t n) {
    size_t took = 0;
    const uint64_t start = written;
    while (took < n) {
      if (chunks[fill] == Chunk::kFree) {
        chunks[fill] = Chunk::kFilling;
        chunkBytes[fill] = 0;
      }
      if (chunks[fill] != Chunk::kFilling) {
        break;
      }
      const size_t part = std::min(kChunkBytes - chunkBytes[fill], n - took);
      std::memcpy(chunk(fill) + chunkBytes[fill], data + took, part);
      chunkBytes[fill] += part;
      took += part;
      written = start + took;
      if (chunkBytes[fill] == kChunkBytes) {
        seal();
      }
    }
    return took;
  }

  void seal() {
    chunkEnd[fill] = written;
    chunks[fill] = Chunk::kSealed;
    sealed.push_back(fill);
    fill = (fill + 1) % kSlots;
  }

  // Sends sealed chunks while the peer has slots for them; true when one went.
  bool postChunks() {
    bool sent = false;
    while (!sealed.empty() && credits > 0 && error.empty() && !gone()) {
      const int i = sealed.front();
      if (!taken(fi_tsend(ep(), chunk(i), chunkBytes[i], desc, address, ownTag(kStreamTag), &chunkPosts[i]),
                 "sending")) {
        break;
      }
      sealed.pop_front();
      --credits;
      postedBytes = chunkEnd[i];
      chunks[i] = Chunk::kPosted;
      inFlight.push_back(i);
      sent = true;
    }
    return sent;
  }

  bool postSlot(int i) {
    return taken(fi_trecv(ep(), slot(i), kChunkBytes, desc, FI_ADDR_UNSPEC, kStreamTag | static_cast<uint64_t>(peer),
                          0, &slotPosts[i]),
                 "posting a receive");
  }

  bool postControlReceive() {
    if (controlReceivePosted || lied) {
      return true;
    }
    controlReceivePosted = taken(fi_trecv(ep(), &creditWords()[0], sizeof(uint64_t), desc, FI_ADDR_UNSPEC,
                                          kControlTag | static_cast<uint64_t>(peer), 0, &controlReceivePost),
                                 "posting a receive");
    return controlReceivePosted;
  }

  // Returns freed slots' credits to the peer; true when some went.
  bool sendCredits() {
    if (creditsToSend == 0 || controlSendBusy || !error.empty() || gone()) {
      return false;
    }
    creditWords()[1] = creditsToSend;
    if (!taken(fi_tsend(ep(), &creditWords()[1], sizeof(uint64_t), desc, address, ownTag(kControlTag),
                        &controlSendPost),
               "returning credits")) {
      return false;
    }
    controlSendBusy = true;
    creditsToSend = 0;
    return true;
  }

  bool sendHello() {
    if (!helloToSend || helloBusy || gone()) {
      return false;
    }
    if (!taken(fi_tsend(ep(), &hello(), sizeof(HelloMessage), desc, address, ownTag(kHelloTag), &helloPost),
               "saying hello")) {
      return false;
    }
    helloToSend = false;
    helloBusy = true;
    return true;
  }

  // Posts the slots waiting to be; owes the peer a credit for each it had used, and returns
  // them once kCreditBatch are owed. True when a slot was posted.
  bool repost() {
    bool posted = false;
    while (!toRepost.empty() && error.empty() && postSlot(toRepost.front())) {
      toRepost.pop_front();
      posted = true;
      if (firstPosts > 0) {
        --firstPosts;
      } else {
        ++owed;
      }
    }
    if (owed >= kCreditBatch) {
      creditsToSend += static_cast<uint64_t>(owed);
      owed = 0;
    }
    return posted;
  }

  // What waits in the stream moves where it can; true when something did.
  bool pump() {
    bool moved = sendHello();
    moved |= repost();
    moved |= !controlReceivePosted && postControlReceive();
    if (!farewell.empty()) {
      const size_t took = accept(farewell.data(), farewell.size());
      farewell.erase(0, took);
      if (chunks[fill] == Chunk::kFilling && chunkBytes[fill] > 0) {
        seal();
      }
      moved |= took > 0;
    }
    moved |= postChunks();
    moved |= sendCredits();
    return moved;
  }

  // Something waits to go out or for its send to complete: with manual progress, nothing
  // leaves unless this rank reads its completion queue.
  bool sending() const {
    if (!error.empty()) {
      return false;
    }
    for (int i = 0; i < kSlots; ++i) {
      if (chunks[i] == Chunk::kSealed || chunks[i] == Chunk::kPosted) {
        return true;
      }
    }
    return !farewell.empty() || helloToSend || helloBusy || creditsToSend > 0 || controlSendBusy;
  }

  // ---- Link ----

  // Why the peer's lifeline ended, in its farewell's words where it gave one.
  std::string endedWhy() const {
    const ofi::Lifelines& lifelines = transport->lifelines_;
    const auto& farewell = lifelines.farewell(peer);
    if (!farewell) {
      return lifelines.endedWhy(peer);
    }
    return farewell->kind == ofi::Farewell::kFault ? rankName(peer) + " gave up on the group: " + farewell->why
                                                   : rankName(peer) + " left the group (destroyed its process group)";
  }

  // An operation with the peer failed: libfabric says so when the peer's endpoint closes,
  // before its lifeline may have told why. For up to kFarewellGrace, 0 (wait); then the error.
  // Once the lifeline ended, what atEnd says.
  ssize_t broken() {
    if (lied) {
      throw CommError(CommError::Kind::kPeer, error);
    }
    if (transport->lifelines_.ended(peer)) {
      return atEnd();
    }
    if (errorSeen == Clock::time_point{}) {
      errorSeen = Clock::now();
    }
    if (Clock::now() - errorSeen < kFarewellGrace) {
      return 0;
    }
    throw CommError(CommError::Kind::kPeer, error);
  }

  size_t write(const iovec* parts, int count) override {
    if (transport->lifelines_.ended(peer)) {
      // Never post to a peer that may be gone: the shm provider spins forever on one. A peer
      // that left takes nothing more, which is no failure by itself (a credit it no longer
      // needs): the reads reach its goodbye, and what waits for the peer fails there.
      const auto& farewell = transport->lifelines_.farewell(peer);
      if (farewell && farewell->kind == ofi::Farewell::kGoodbye) {
        return 0;
      }
      throw CommError(CommError::Kind::kPeer, endedWhy());
    }
    if (!error.empty()) {
      broken();
      return 0;
    }
    size_t took = 0;
    for (int i = 0; i < count; ++i) {
      const size_t part = accept(static_cast<const char*>(parts[i].iov_base), parts[i].iov_len);
      took += part;
      if (part < parts[i].iov_len) {
        break;
      }
    }
    return took;
  }

  // A chunk's send completed.
  void sent(int i) {
    sendDone[i] = true;
    while (!inFlight.empty() && sendDone[inFlight.front()]) {
      const int oldest = inFlight.front();
      inFlight.pop_front();
      sendDone[oldest] = false;
      handedOn = chunkEnd[oldest];
      chunks[oldest] = Chunk::kFree;
    }
  }

  uint64_t sentBytes() const override {
    const auto& farewell = transport->lifelines_.farewell(peer);
    return farewell && farewellChecked && !lied ? std::max(handedOn, farewell->readBytes) : handedOn;
  }

  void flush() override {
    if (chunks[fill] == Chunk::kFilling && chunkBytes[fill] > 0) {
      seal();
    }
    postChunks();
  }

  ssize_t read(char* dst, size_t n) override {
    if (lied) {
      throw CommError(CommError::Kind::kPeer, error);
    }
    // What arrived before an error (the peer's last chunks, a fault frame) is read first.
    size_t got = 0;
    while (got < n && filled[head]) {
      const size_t part = std::min(slotBytes[head] - headRead, n - got);
      std::memcpy(dst + got, slot(head) + headRead, part);
      got += part;
      headRead += part;
      if (headRead == slotBytes[head]) {
        filled[head] = false;
        headRead = 0;
        toRepost.push_back(head);
        head = (head + 1) % kSlots;
      }
    }
    readBytes += got;
    if (got > 0) {
      return static_cast<ssize_t>(got);
    }
    return error.empty() ? atEnd() : broken();
  }

  // Nothing to read: 0 while the peer lives, -1 at the end of what it sent before it left, or
  // CommError when it died or its last bytes never came.
  ssize_t atEnd() {
    const ofi::Lifelines& lifelines = transport->lifelines_;
    if (!lifelines.ended(peer)) {
      return 0;
    }
    const auto& farewell = lifelines.farewell(peer);
    if (endSeen == Clock::time_point{}) {
      endSeen = Clock::now();
    }
    if (!farewell) {
      // Killed, or gone before its farewell could be written: a fault frame it sent may still
      // be on the fabric, and says better why.
      if (Clock::now() - endSeen < kFarewellGrace) {
        return 0;
      }
      throw CommError(CommError::Kind::kPeer, endedWhy());
    }
    if (readBytes >= farewell->streamBytes && farewell->kind == ofi::Farewell::kGoodbye) {
      return -1;
    }
    if (readBytes < farewell->streamBytes && Clock::now() - endSeen < kStreamEndGrace) {
      return 0;
    }
    throw CommError(CommError::Kind::kPeer,
                    farewell->kind == ofi::Farewell::kFault
                        ? endedWhy()
                        : rankName(peer) + " left the group, but " +
                              std::to_string(farewell->streamBytes - readBytes) + " bytes it sent never arrived");
  }

  void consumed() override {
    repost();
    sendCredits();
  }

  bool peerSaidGoodbye() const override {
    const auto& farewell = transport->lifelines_.farewell(peer);
    return farewell && farewell->kind == ofi::Farewell::kGoodbye;
  }

  size_t peerReadsAbove() const override {
    return transport->fabric_.offersRma() ? transport->rmaAbove_ : SIZE_MAX;
  }

  uint64_t lend(const void* buf, size_t n) override {
    ofi::Region loan;
    std::string why;
    if (!transport->fabric_.registerMemory(buf, n, FI_REMOTE_READ, &loan, &why)) {
      throw CommError(CommError::Kind::kPeer, "cannot lend a message of " + std::to_string(n) + " bytes to " +
                                                  rankName(peer) + ": " + why);
    }
    loans[loan.key] = loan;
    return loan.key;
  }

  void endLoan(uint64_t key) override {
    auto it = loans.find(key);
    if (it != loans.end()) {
      transport->fabric_.deregister(it->second);
      loans.erase(it);
    }
  }

  void startRead(uint64_t address, uint64_t key, char* dst, size_t n) override;
  bool continueRead() override;
  void abandonRead() override;
  // One step of the read under way; continueRead's answer. Throws CommError.
  bool stepRead();
  // Posts the next piece of the read under way into reader; false when the provider asks to
  // try again later.
  bool postPiece();
  // Throws CommError when a read of n bytes can end well no more: the peer's lifeline ended, an
  // operation with it failed, the group is being aborted, or the deadline passed. A read that
  // was `posted` is given up on first (abandoned).
  void checkRead(size_t n, Deadline deadline, bool posted);
  // Its completion arrived: a read given up on goes, with its memory and registration.
  void finishRead(Read* read, int state, const std::string& why);

  // The read under way (Link::startRead): `piece` bytes of it posted into reader when `posted`.
  struct Reading {
    uint64_t remote = 0; // the peer's address of the first byte, as the provider takes it
    uint64_t key = 0;
    char* dst = nullptr;
    size_t n = 0;
    size_t done = 0;
    size_t piece = 0;
    bool posted = false;
    Deadline deadline;
  };
  std::optional<Reading> reading;
  std::unique_ptr<Read> reader; // the memory reads land in, between reads; made at the first
  std::vector<std::unique_ptr<Read>> abandoned; // reads given up on whose completion has not come
};

void OfiTransport::Stream::startRead(uint64_t remote, uint64_t key, char* dst, size_t n) {
  // Never waited for: the message layer moves it on (continueRead) on every pass of its
  // progress loop, which releases the transport's lock between passes; the read's own deadline
  // is the group's timeout, and each step looks at the peer's lifeline and at abort().
  Reading read;
  read.remote = transport->fabric_.remoteAddress(remote);
  read.key = key;
  read.dst = dst;
  read.n = n;
  read.deadline = Clock::now() + transport->timeout_;
  checkRead(n, read.deadline, false);
  reading = read;
}

bool OfiTransport::Stream::continueRead() {
  try {
    return stepRead();
  } catch (const CommError&) {
    reading.reset(); // checkRead abandoned a posted piece already
    throw;
  }
}

bool OfiTransport::Stream::stepRead() {
  Reading& read = *reading;
  if (read.posted) {
    if (reader->state == 0) {
      checkRead(read.n, read.deadline, true);
      return false;
    }
    read.posted = false;
    if (reader->state < 0) {
      throw CommError(CommError::Kind::kPeer, "libfabric: reading " + std::to_string(read.piece) + " bytes from " +
                                                  rankName(peer) + " failed: " + reader->error);
    }
    std::memcpy(read.dst + read.done, reader->memory.get(), read.piece);
    read.done += read.piece;
  }
  if (read.done == read.n) {
    reading.reset();
    return true;
  }
  if (!postPiece()) {
    // rxm answers -FI_EAGAIN for as long as a killed peer's connection is not torn down.
    checkRead(read.n, read.deadline, false);
  }
  return false;
}

bool OfiTransport::Stream::postPiece() {
  Reading& read = *reading;
  const size_t n = std::min(kReadPieceBytes, read.n - read.done);
  ofi::Fabric& fabric = transport->fabric_;
  if (!reader || reader->capacity < n) {
    if (reader) {
      fabric.deregister(reader->region);
    }
    reader = std::make_unique<Read>();
    reader->stream = this;
    reader->post = ofi::Posted{{}, reader.get(), kRead, 0};
    reader->capacity = std::min(kReadPieceBytes, std::max(n, kChunkBytes));
    reader->memory.reset(new char[reader->capacity]);
    std::string why;
    if (fabric.registersLocal() &&
        !fabric.registerMemory(reader->memory.get(), reader->capacity, FI_READ, &reader->region, &why)) {
      reader.reset();
      throw CommError(CommError::Kind::kPeer, "cannot read " + std::to_string(n) + " bytes from " + rankName(peer) +
                                                  ": " + why);
    }
  }
  reader->state = 0;
  reader->error.clear();
  const ssize_t result = fi_read(ep(), reader->memory.get(), n, reader->region.desc, address, read.remote + read.done,
                                 read.key, &reader->post);
  if (result == -FI_EAGAIN) {
    return false;
  }
  if (result != 0) {
    throw CommError(CommError::Kind::kPeer, "libfabric: reading " + std::to_string(n) + " bytes from " +
                                                rankName(peer) + " failed: " + ofi::errorText(static_cast<int>(-result)));
  }
  read.piece = n;
  read.posted = true;
  return true;
}

void OfiTransport::Stream::abandonRead() {
  if (reading && reading->posted) {
    // Its completion may still come, and lands in memory of the stream's own.
    reader->abandoned = true;
    abandoned.push_back(std::move(reader));
  }
  reading.reset();
}

void OfiTransport::Stream::checkRead(size_t n, Deadline deadline, bool posted) {
  transport->checkLifelines(false);
  CommError::Kind kind = CommError::Kind::kPeer;
  std::string why;
  if (gone()) {
    why = endedWhy();
  } else if (!error.empty()) {
    why = error;
  } else if (transport->aborting_) {
    kind = CommError::Kind::kAborted;
    why = "the group was aborted while reading " + std::to_string(n) + " bytes from " + rankName(peer);
  } else if (Clock::now() >= deadline) {
    kind = CommError::Kind::kTimeout;
    why = "timed out reading " + std::to_string(n) + " bytes from " + rankName(peer) + " after " +
          std::to_string(transport->timeout_.count()) + " ms";
  } else {
    return;
  }
  if (posted) {
    reader->abandoned = true;
    abandoned.push_back(std::move(reader));
  }
  throw CommError(kind, why);
}

void OfiTransport::Stream::finishRead(Read* read, int state, const std::string& why) {
  if (!read->abandoned) {
    read->state = state;
    read->error = why;
    return;
  }
  transport->fabric_.deregister(read->region);
  for (auto it = abandoned.begin(); it != abandoned.end(); ++it) {
    if (it->get() == read) {
      abandoned.erase(it);
      return;
    }
  }
}

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
    rendezvous_ = std::move(rendezvous);
  }
  joinHelper();
}

OfiTransport::~OfiTransport() {
  leaveHelper();
  std::unique_lock<std::mutex> lock(mutex_);
  destroying_ = true;
  for (Stream* stream : made_) {
    if (peerFailure(stream->peer).empty() && betweenFrames(stream->peer)) {
      stream->farewell += ownFrame(kGoodbyeFrame);
    }
  }
  sayFarewells(groupFailure().empty() ? ofi::Farewell::kGoodbye : ofi::Farewell::kFault, groupFailure());
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

void OfiTransport::onHello(const HelloMessage& hello) {
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
  if (Clock::now() < lookup.nextTry) {
    return false;
  }
  if (published_[peer].empty()) {
    std::string failure;
    auto found = lookUpPublished(*rendezvous_, "ofi/" + std::to_string(peer), lookup.deadline, &lookup.nextTry,
                                 &lookup.tries, &failure);
    if (!failure.empty()) {
      failPeer(peer, cannot + ": " + failure);
      return true;
    }
    if (!found) {
      return false;
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
    onHello(hellos_[posted->index]);
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
      wakeAt = std::min(wakeAt, lookup.nextTry);
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
