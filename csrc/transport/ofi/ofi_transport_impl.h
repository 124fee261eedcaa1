// What the OFI transport's two files share (ofi_transport.cc, the transport and its peers' setup;
// ofi_stream.cc, the stream to one peer): the stream's protocol (chunk and slot sizes, tags, what
// each post is, the fabric hello) and the OfiTransport class. Private to csrc/transport/ofi/; the
// design is in ofi_transport.h.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/group_secret.h"
#include "transport/ofi/fabric.h"
#include "transport/ofi/lifelines.h"
#include "transport/ofi/ofi_transport.h"

namespace torus {

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
// After a peer's farewell, the rest of its stream may still be on the way for this long.
constexpr auto kStreamEndGrace = std::chrono::seconds(2);
// After an operation with a peer failed, or its lifeline closed without a farewell, the lifeline
// or the stream may still say why for this long.
constexpr auto kFarewellGrace = std::chrono::milliseconds(500);
// An RMA read lands in memory of the stream's own, this much at a time, and is copied from there
// into the receive's buffer: a read given up on (its peer died, the group aborted, its deadline
// passed) may still land later, and must never land in a buffer its failed receive gave back.
constexpr size_t kReadPieceBytes = 4 << 20;

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
  // A hello of `bytes` arrived: a stream is made for a peer that proves it belongs.
  void onHello(const HelloMessage& hello, size_t bytes);
  // Looks at the lifelines (at most every kLifelineCheck unless `now`); true when a peer ended.
  bool checkLifelines(bool now);
  // This rank's farewell (the bytes of each stream, `why`) on every lifeline, now and later.
  void sayFarewells(ofi::Farewell::Kind kind, const std::string& why);

  ofi::Fabric fabric_;
  ofi::Lifelines lifelines_;
  Gatekeeper gate_;
  const size_t rmaAbove_;
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<PublishedLookups> addressLookups_; // set where peers' addresses are looked up lazily
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

} // namespace torus
