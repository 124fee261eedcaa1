// What TcpTransport and ShmTransport share: requests kept the same way, and waits in which one
// thread at a time drives progress (progress() of the transport) while other waiting threads
// sleep until it has moved something. Knows nothing of sockets or shared memory.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
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
  // A probe's payload: the tag it asks about (see probeWaits in the transports).
  uint64_t probedTag = 0;

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

// Fails the receives of `tag` in `queues` (posted receives by tag, of either transport) whose call
// disagrees with `call`, which `sender` runs there, and removes them so that no later message
// lands in their buffers; true when one failed.
template <typename Op>
bool failDisagreeingIn(std::map<uint64_t, std::deque<std::shared_ptr<Op>>>& queues, int sender, uint64_t tag,
                       const CallSignature& call) {
  auto it = queues.find(tag);
  if (it == queues.end()) {
    return false;
  }
  bool failed = false;
  auto& ops = it->second;
  for (auto op = ops.begin(); op != ops.end();) {
    if ((*op)->call.agreesWith(call)) {
      ++op;
      continue;
    }
    (*op)->fail(CommError::Kind::kMismatch, "rank " + std::to_string(sender) + " runs a different call");
    (*op)->mismatch = CallMismatch{sender, tag, (*op)->call, call};
    op = ops.erase(op);
    failed = true;
  }
  if (ops.empty()) {
    queues.erase(it);
  }
  return failed;
}

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

 protected:
  // With mutex_ held: one non-blocking attempt on every peer; true when a request completed.
  virtual bool tryAll() = 0;
  // With mutex_ held, by the one driving thread: moves what it can, sleeping (lock released)
  // until something happens or the deadline; returns to let wait() look at its requests.
  virtual void progress(std::unique_lock<std::mutex>& lock, Deadline deadline) = 0;
  // The first part of every progress(): tryAll() for up to kSpinBeforeSleep, yielding the core
  // between attempts (the peer we wait for often shares it, and a yield lets it run at once
  // where a sleep costs a wake-up); true when something completed.
  bool spinBriefly(std::unique_lock<std::mutex>& lock);

  mutable std::mutex mutex_;
  std::condition_variable progressed_;
  bool progressing_ = false;
};

} // namespace torus
