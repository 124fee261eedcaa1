// What a transport offers the layers above: non-blocking, tagged, ordered point-to-point
// messages between ranks, and waits that end at a deadline.
//
// Messages between two ranks with the same tag arrive in the order they were sent. A receive
// must name the exact size of the message it matches; a different size is a mismatch error,
// never a truncation. Knows nothing of torch.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace torus {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// "rank 3": how every error names a rank.
inline std::string rankName(int rank) {
  return "rank " + std::to_string(rank);
}

// How long a wait spins, yielding the core, before it sleeps: long enough to catch a peer that
// answers within microseconds, short enough not to burn an oversubscribed host's cores.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);

// What every message of a collective says about the call that sent it, so that ranks that
// disagree on a collective (its kind, dtype, reduction, root, algorithm, size or whether a
// callback issued it) find out at its first message instead of exchanging bytes they would misread.
// Transports only compare it; the backend gives the fields their meaning. kind 0
// (point-to-point) agrees with anything.
struct CallSignature {
  // Where the call was issued from: the caller's own code, or a future's callback. A callback's
  // collective and the caller's, paired at one sequence number, are two ranks that placed them
  // differently (CallbackScope).
  static constexpr uint16_t kOriginCaller = 0;
  static constexpr uint16_t kOriginCallback = 1;

  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t op = 0;
  uint8_t algorithm = 0;
  int32_t root = -1;
  // 48 bits (256 TiB) leave room for the origin in the header's 16 bytes.
  uint64_t nbytes : 48 = 0;
  uint64_t origin : 16 = kOriginCaller;

  bool agreesWith(const CallSignature& other) const {
    return kind == 0 || other.kind == 0 ||
           (kind == other.kind && dtype == other.dtype && op == other.op && algorithm == other.algorithm &&
            root == other.root && nbytes == other.nbytes && origin == other.origin);
  }
};
static_assert(sizeof(CallSignature) == 16, "CallSignature travels in message headers");

// Two ranks called different collectives at the same sequence number (the message tag).
struct CallMismatch {
  int peer; // transport rank
  uint64_t tag;
  CallSignature mine;
  CallSignature theirs;
};

// Failures that end a collective. The backend turns kPeer and kTimeout into
// torch.distributed.DistBackendError.
class CommError : public std::runtime_error {
 public:
  enum class Kind { kPeer, kTimeout, kMismatch, kAborted };
  CommError(Kind kind, const std::string& what, std::optional<CallMismatch> mismatch = std::nullopt)
      : std::runtime_error(what), kind_(kind), mismatch_(mismatch) {}
  Kind kind() const {
    return kind_;
  }
  // Set when kind() is kMismatch because a peer's call differs from this rank's.
  const std::optional<CallMismatch>& mismatch() const {
    return mismatch_;
  }

 private:
  Kind kind_;
  std::optional<CallMismatch> mismatch_;
};

// Tags: collectives use their sequence number; point-to-point calls use kP2PTagBase + user tag.
constexpr uint64_t kP2PTagBase = uint64_t(1) << 62;
constexpr int kAnyPeer = -1;

class SharedMemory;
class TrafficCounters;

class Request {
 public:
  virtual ~Request() = default;
  // The peer this request exchanged with (for a receive from any peer, the one that matched).
  virtual int peer() const = 0;
  // Keeps `owner` (whatever owns the request's buffer) alive for as long as the transport holds
  // the request, so that a caller that drops a request before it completes frees nothing the
  // transport may still read or write.
  void holdBuffer(std::shared_ptr<const void> owner) {
    bufferOwner_ = std::move(owner);
  }

 private:
  std::shared_ptr<const void> bufferOwner_;
};
using RequestPtr = std::shared_ptr<Request>;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // buf must stay valid and unchanged until the request completes. `call` travels with the
  // message; a receive whose call disagrees with the message's fails with kMismatch.
  virtual RequestPtr isend(int peer, uint64_t tag, const CallSignature& call, const void* buf, size_t nbytes) = 0;
  // peer may be kAnyPeer.
  virtual RequestPtr irecv(int peer, uint64_t tag, const CallSignature& call, void* buf, size_t nbytes) = 0;

  // Blocks until every request completes; throws CommError on peer failure, mismatch, abort or
  // when the deadline passes (naming the peers still owed). Waiting drives progress of all
  // outstanding requests, so one rank's sends move while it waits on its receives.
  virtual void wait(const std::vector<RequestPtr>& requests, Deadline deadline) = 0;
  // Non-blocking: makes what progress it can; true when the request completed (throws as wait).
  virtual bool test(const RequestPtr& request) = 0;

  // Fails every pending and future request with kAborted and wakes all waiters; the transport
  // never touches a request's buffer afterwards. Tells every peer why, so that they fail their
  // pending and future requests at once, naming this rank and the reason, instead of waiting for
  // their timeouts.
  virtual void abort(const std::string& why) = 0;

  // A held message of a collective tagged `upToTag` or lower, although every receive of those
  // collectives has completed: its sender ran a different call (say, another root). The backend
  // asks after each collective.
  struct StrayMessage {
    int peer;
    uint64_t tag;
    CallSignature call;
  };
  virtual std::optional<StrayMessage> strayMessage(uint64_t upToTag) = 0;

  // Shared memory among `members` (transport ranks, this rank among them; the SharedMemory
  // numbers them 0..k-1 in this order), or nullptr when this transport does not reach every one
  // of them through shared memory. `traffic` (may be null) counts its single copies.
  virtual std::shared_ptr<SharedMemory> sharedMemory(const std::vector<int>& members,
                                                     std::shared_ptr<TrafficCounters> traffic) {
    return nullptr;
  }
};

} // namespace torus
