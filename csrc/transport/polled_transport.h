// What TcpTransport and ShmTransport share: requests kept the same way, and waits in which one
// thread at a time drives progress (progress() of the transport) while other waiting threads
// sleep until it has moved something. Knows nothing of sockets or shared memory.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
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

// Removes and returns the oldest entry of `tag` in `queues` (first-in first-out per tag: held
// messages, or posted receives); nullopt when there is none.
template <typename T>
std::optional<T> popOldest(std::map<uint64_t, std::deque<T>>& queues, uint64_t tag) {
  auto it = queues.find(tag);
  if (it == queues.end()) {
    return std::nullopt;
  }
  T oldest = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) {
    queues.erase(it);
  }
  return oldest;
}

// The receive an arriving message of `tag` from `sender` goes to: the oldest posted for that
// sender, else the oldest posted for any peer; null when none is posted.
template <typename Op>
std::shared_ptr<Op> matchPostedReceive(std::map<uint64_t, std::deque<std::shared_ptr<Op>>>& posted,
                                       std::map<uint64_t, std::deque<std::shared_ptr<Op>>>& anyPeer, uint64_t tag,
                                       int sender) {
  for (auto* queues : {&posted, &anyPeer}) {
    if (auto op = popOldest(*queues, tag)) {
      (*op)->peerRank = sender;
      return *op;
    }
  }
  return nullptr;
}

// Posts receive `op` of `tag` from `peer` (kAnyPeer: any of `peers`, in rank order), with the
// transport's lock held. takeHeld(peerState, op) hands op the oldest message of the tag that
// peer holds and returns true, or returns false when it holds none. A receive nothing held
// answers fails at once when its peer has failed, else waits in the peer's posted queue (or in
// anyPeer's).
template <typename Op, typename PeerState, typename TakeHeld>
void postReceive(const std::shared_ptr<Op>& op, int peer, uint64_t tag,
                 std::vector<std::unique_ptr<PeerState>>& peers,
                 std::map<uint64_t, std::deque<std::shared_ptr<Op>>>& anyPeer, TakeHeld takeHeld) {
  if (peer == kAnyPeer) {
    for (auto& state : peers) {
      if (state && takeHeld(*state, *op)) {
        return;
      }
    }
    anyPeer[tag].push_back(op);
    return;
  }
  PeerState& state = *peers[peer];
  if (takeHeld(state, *op)) {
    return;
  }
  if (!state.failure.empty()) {
    op->fail(CommError::Kind::kPeer, state.failure);
    return;
  }
  state.posted[tag].push_back(op);
}

// The probes (kProbeTag) to send `peer` about the collectives this rank waits on it in, but for
// the one it asked about last. A probe's payload is the collective's tag; it carries the
// collective's call.
template <typename Op, typename PeerState>
std::vector<std::shared_ptr<Op>> probesFor(PeerState& peer) {
  std::vector<std::shared_ptr<Op>> probes;
  for (auto& [tag, ops] : peer.posted) {
    const CallSignature& call = ops.front()->call;
    if (call.kind == 0 || peer.probedTag == tag) {
      continue;
    }
    peer.probedTag = tag;
    auto probe = makeOp<Op>(nullptr, true, ops.front()->peerRank, kProbeTag, call, nullptr, sizeof(uint64_t));
    probe->probedTag = tag;
    probe->buf = reinterpret_cast<char*>(&probe->probedTag);
    probes.push_back(std::move(probe));
  }
  return probes;
}

// Fails every request in `queues` (posted receives by tag) and empties it.
template <typename Op>
void failQueued(std::map<uint64_t, std::deque<std::shared_ptr<Op>>>& queues, CommError::Kind kind,
                const std::string& why) {
  for (auto& entry : queues) {
    for (auto& op : entry.second) {
      op->fail(kind, why);
    }
  }
  queues.clear();
}

// A group with a dead member cannot finish any collective: every pending request fails and
// names it, including those with live peers (which may wait on something the dead rank owed),
// and every peer is marked failed, as after abort(), so no request touches a buffer afterwards.
// failPending(peerState) fails one peer's requests; `anyPeer` holds receives from any peer.
template <typename Op, typename PeerState, typename FailPending>
void failEveryPeer(std::vector<std::unique_ptr<PeerState>>& peers,
                   std::map<uint64_t, std::deque<std::shared_ptr<Op>>>& anyPeer, const std::string& why,
                   FailPending failPending) {
  for (auto& other : peers) {
    if (other) {
      failPending(*other);
      other->failure = why;
    }
  }
  failQueued(anyPeer, CommError::Kind::kPeer, why);
}

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
