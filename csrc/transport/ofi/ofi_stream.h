// OfiTransport::Stream: the Link to one peer, a stream of chunks each way with its receive slots,
// credits, hello, farewell checks and RMA reads (the protocol is in ofi_transport.h).
#pragma once

#include <deque>
#include <optional>
#include <unordered_map>
#include <vector>

#include "transport/ofi/ofi_transport_impl.h"

namespace torus {

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
  // Whom the stream's receives take chunks and credits from: the peer's endpoint alone (the one
  // the store published, or that its proven hello named), where the provider directs receives.
  fi_addr_t sender() const {
    return transport->fabric_.directsReceives() ? address : FI_ADDR_UNSPEC;
  }

  // Before the endpoint closes: no memory of the stream's stays registered.
  void release();

  // The peer's lifeline ended: nothing more is posted to it (a send to a dead peer may never
  // return to the shm provider, and no peer that ended reads any more).
  bool gone() const {
    return transport->lifelines_.ended(peer);
  }

  // The peer sent `what`, which the protocol never sends (a corrupt or forged word): nothing
  // more is posted to it, and its Link fails at once, naming it and the field.
  void brokeProtocol(const std::string& what);

  // The peer's farewell, once it came: the counts it gives must fit what this rank sent and read.
  void checkFarewell();

  void broke(const std::string& what, ssize_t result);

  // Whether a post was taken: false when the provider is full for now (-FI_EAGAIN, tried again
  // later) or the post failed (the stream then broke, naming `what`).
  bool taken(ssize_t result, const char* what);

  // Takes what fits of `n` bytes into chunks; returns how many.
  size_t accept(const char* data, size_t n);

  void seal();

  // Sends sealed chunks while the peer has slots for them; true when one went.
  bool postChunks();

  bool postSlot(int i);

  bool postControlReceive();

  // Returns freed slots' credits to the peer; true when some went.
  bool sendCredits();

  bool sendHello();

  // Posts the slots waiting to be; owes the peer a credit for each it had used, and returns
  // them once kCreditBatch are owed. True when a slot was posted.
  bool repost();

  // What waits in the stream moves where it can; true when something did.
  bool pump();

  // Something waits to go out or for its send to complete: with manual progress, nothing
  // leaves unless this rank reads its completion queue.
  bool sending() const;

  // ---- Link ----

  // Why the peer's lifeline ended, in its farewell's words where it gave one.
  std::string endedWhy() const;

  // An operation with the peer failed: libfabric says so when the peer's endpoint closes,
  // before its lifeline may have told why. For up to kFarewellGrace, 0 (wait); then the error.
  // Once the lifeline ended, what atEnd says.
  ssize_t broken();

  size_t write(const iovec* parts, int count) override;

  // A chunk's send completed.
  void sent(int i);

  uint64_t sentBytes() const override;

  void flush() override;

  ssize_t read(char* dst, size_t n) override;

  // Nothing to read: 0 while the peer lives, -1 at the end of what it sent before it left, or
  // CommError when it died or its last bytes never came.
  ssize_t atEnd();

  void consumed() override;

  bool peerSaidGoodbye() const override;
  Departure peerDeparture() const override;

  size_t peerReadsAbove() const override;

  uint64_t lend(const void* buf, size_t n) override;

  void endLoan(uint64_t key) override;

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

} // namespace torus
