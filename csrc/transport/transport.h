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
#include <stdexcept>
#include <string>
#include <vector>

namespace torus {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// How long a wait spins, yielding the core, before it sleeps: long enough to catch a peer that
// answers within microseconds, short enough not to burn an oversubscribed host's cores.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);

// Failures that end a collective. The backend turns kPeer and kTimeout into
// torch.distributed.DistBackendError.
class CommError : public std::runtime_error {
 public:
  enum class Kind { kPeer, kTimeout, kMismatch, kAborted };
  CommError(Kind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  Kind kind() const {
    return kind_;
  }

 private:
  Kind kind_;
};

// Tags: collectives use their sequence number; point-to-point calls use kP2PTagBase + user tag.
constexpr uint64_t kP2PTagBase = uint64_t(1) << 62;
constexpr int kAnyPeer = -1;

class Request {
 public:
  virtual ~Request() = default;
  // The peer this request exchanged with (for a receive from any peer, the one that matched).
  virtual int peer() const = 0;
};
using RequestPtr = std::shared_ptr<Request>;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // buf must stay valid and unchanged until the request completes.
  virtual RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t nbytes) = 0;
  // peer may be kAnyPeer.
  virtual RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t nbytes) = 0;

  // Blocks until every request completes; throws CommError on peer failure, mismatch, abort or
  // when the deadline passes (naming the peers still owed). Waiting drives progress of all
  // outstanding requests, so one rank's sends move while it waits on its receives.
  virtual void wait(const std::vector<RequestPtr>& requests, Deadline deadline) = 0;
  // Non-blocking: makes what progress it can; true when the request completed (throws as wait).
  virtual bool test(const RequestPtr& request) = 0;

  // Fails every pending and future request with kAborted and wakes all waiters; the transport
  // never touches a request's buffer afterwards. Connections stay open (until destruction), so
  // peers see their own timeouts rather than a cascade of closed connections.
  virtual void abort(const std::string& why) = 0;
};

} // namespace torus
