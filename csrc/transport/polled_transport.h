// Requests, and waits in which one thread at a time drives progress (progress() of the
// transport) while other waiting threads sleep until it has moved something. Knows nothing of
// sockets or shared memory.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace torus {

// A send or receive in flight. Transports extend it with what their wire needs.
struct PendingOp : Request {
  // The transport that made it (a transport over two others routes waits by it).
  const Transport* owner = nullptr;
  bool isSend = false;
  int peerRank = 0; // kAnyPeer for a receive from any peer until one matches
  uint64_t tag = 0;
  CallSignature call;
  char* buf = nullptr;
  size_t nbytes = 0;
  bool complete = false;
  std::string error;
  CommError::Kind errorKind = CommError::Kind::kPeer;
  std::optional<CallMismatch> mismatch;

  int peer() const override {
    return peerRank;
  }
  // Completes the request with an error, unless it completed already.
  void fail(CommError::Kind kind, const std::string& why) {
    if (!complete) {
      complete = true;
      errorKind = kind;
      error = why;
    }
  }
  // For a receive matched to a message of `theirCall` and `theirBytes` from `peer`: true when
  // the message belongs to the same call and fits; otherwise fails the receive with kMismatch.
  bool accepts(int peer, const CallSignature& theirCall, size_t theirBytes);
};

// A new request of type Op (a PendingOp) for `peer`: a send of `buf` when isSend, else a receive
// into it.
template <typename Op>
std::shared_ptr<Op> makeOp(const Transport* owner, bool isSend, int peer, uint64_t tag, const CallSignature& call,
                           const void* buf, size_t nbytes) {
  auto op = std::make_shared<Op>();
  op->owner = owner;
  op->isSend = isSend;
  op->peerRank = peer;
  op->tag = tag;
  op->buf = const_cast<char*>(static_cast<const char*>(buf));
  op->nbytes = nbytes;
  op->call = call;
  return op;
}

// Milliseconds from now until `when` for poll(), rounded up and at most `cap` (also when `when`
// is the end of time).
int millisecondsUntil(Clock::time_point when, int cap);

// "receive of 4000 bytes from rank 1, send of ..." for the requests not yet complete.
std::string describePending(const std::vector<RequestPtr>& requests);

class PolledTransport : public Transport {
 public:
  void wait(const std::vector<RequestPtr>& requests, Deadline deadline) final;
  bool test(const RequestPtr& request) final;
  // As wait(), but returns false once `until` has passed (after at least one attempt to make
  // progress) instead of throwing.
  bool waitFor(const std::vector<RequestPtr>& requests, Deadline until);
  // One non-blocking attempt to move every pending request, unless a waiting thread is at it.
  void poke();

  // How long requests may stay pending with no thread driving progress before the helper does.
  static constexpr auto kUnattended = std::chrono::milliseconds(20);

 protected:
  // With mutex_ held: one non-blocking attempt on every peer; true when a request completed.
  virtual bool tryAll() = 0;
  // With mutex_ held, by the one driving thread: moves what it can, sleeping (lock released)
  // until something happens or the deadline; returns to let wait() look at its requests.
  virtual void progress(std::unique_lock<std::mutex>& lock, Deadline deadline) = 0;
  // With mutex_ held: wakes the thread sleeping in progress(), if one is.
  virtual void wakeSleeper() = 0;
  // With mutex_ held: some request is still pending.
  virtual bool hasPending() const = 0;
  // With mutex_ held through `lock`, by a thread making progress (progress(), test(), poke()):
  // a bounded piece of work that runs with the lock released (a piece of a long copy), so that
  // other threads' calls and other requests move meanwhile; true when it did some. The lock is
  // held again on return; tryAll() then sees what the work finished.
  virtual bool workOutsideLock(std::unique_lock<std::mutex>& lock) {
    return false;
  }
  // The first part of every progress(): tryAll() for up to kSpinBeforeSleep, yielding the core
  // between attempts (the peer we wait for often shares it, and a yield lets it run at once
  // where a sleep costs a wake-up); true when something completed, or when workOutsideLock did
  // a piece of work (then progress() returns, and the next pass looks again at once).
  bool spinBriefly(std::unique_lock<std::mutex>& lock);

  // The helper: one thread per process that drives a transport's progress when its requests
  // have been pending for kUnattended with no thread driving it, so that a send or receive
  // nobody waits on still completes (as gloo's do); it hands over to the first thread that
  // waits. A transport joins once it can move messages and leaves first thing when destroyed.
  void joinHelper();
  void leaveHelper();

  mutable std::mutex mutex_;
  std::condition_variable progressed_;
  bool progressing_ = false;

 private:
  struct Progressing;
  friend class ProgressHelper;
  // By the helper: one progress() call if the transport has been unattended since the last
  // visit; true when it drove progress.
  bool helpIfUnattended();
  // For test() and poke(), which hold no driving role: one tryAll(), and a piece of the work
  // outside the lock, after which a thread that drives progress meanwhile is woken to see it.
  bool tryAllOnce(std::unique_lock<std::mutex>& lock);

  bool leaving_ = false;
  bool helperDriving_ = false;
  // Threads waiting for the helper to hand progress over.
  int waitersWanting_ = 0;
  // Counts the times a thread other than the helper drove progress (or tried to), and the count
  // the helper saw last.
  uint64_t progressRuns_ = 0;
  uint64_t helperSeen_ = 0;
};

} // namespace torus
