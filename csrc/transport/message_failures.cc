// The message layer's failures: a peer that broke the protocol, closed, vanished, failed or left,
// what waits on it failed with why; calls that disagree; abort, told to every peer that can hear.
#include <algorithm>
#include <thread>

#include "transport/message_transport_impl.h"

namespace torus {

namespace {

// How long a peer that vanished without a word waits for another peer's reason (peerVanished):
// enough for a peer on a busy host to read a fault frame, give up and say so.
constexpr auto kReasonGrace = std::chrono::milliseconds(200);

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

template <typename Op>
void failAwaiting(std::unordered_map<uint64_t, std::shared_ptr<Op>>& ops, CommError::Kind kind,
                  const std::string& why) {
  for (auto& entry : ops) {
    entry.second->fail(kind, why);
  }
  ops.clear();
}

// Fails the receives of `tag` in `queues` whose call disagrees with `call`, which `sender` runs
// there, and removes them so that no later message lands in their buffers; true when one failed.
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
    (*op)->fail(CommError::Kind::kMismatch, rankName(sender) + " runs a different call");
    (*op)->mismatch = CallMismatch{sender, tag, (*op)->call, call};
    op = ops.erase(op);
    failed = true;
  }
  if (ops.empty()) {
    queues.erase(it);
  }
  return failed;
}

} // namespace

bool MessageTransport::brokeProtocol(Peer& peer, const std::string& what) {
  failPeer(peer.rank, rankName(peer.rank) + " broke the wire protocol: it sent " + what +
                          "; this rank reads nothing more from it");
  return true;
}

void MessageTransport::peerClosed(Peer& peer) {
  if (peer.inPayload && peer.header.kind == kFaultFrame) {
    failPeer(peer.rank, rankName(peer.rank) + " gave up on the group: " +
                            std::string(peer.holding.data(), peer.payloadRead));
  } else if (peer.left || peer.link->peerSaidGoodbye()) {
    // What the peer received before it left is delivered, though its Link may have
    // learned so only from the peer's goodbye.
    confirmSends(peer);
    peerLeft(peer.rank, departureText(peer.rank, peer.left ? peer.departure : peer.link->peerDeparture()));
  } else {
    peerVanished(peer.rank, rankName(peer.rank) +
                                " closed its connection (the process exited, was killed or aborted its group)");
  }
}

void MessageTransport::endLoan(Peer& peer, Op& op) {
  if (op.loan && peer.link) {
    peer.link->endLoan(*op.loan);
  }
  op.loan.reset();
}

void MessageTransport::failPending(Peer& peer, CommError::Kind kind, const std::string& why) {
  for (auto& frame : peer.sends) {
    if (frame.op) {
      endLoan(peer, *frame.op);
      frame.op->fail(kind, why);
    }
  }
  for (auto& entry : peer.awaitingAnswer) {
    endLoan(peer, *entry.second);
  }
  if (peer.headSent != 0) {
    peer.cut = true;
    if (!peer.broke) {
      peer.rest = restOfFrame(peer.rank);
    }
  }
  peer.sends.clear();
  peer.headSent = 0;
  for (auto& entry : peer.unconfirmed) {
    entry.second->fail(kind, why);
  }
  peer.unconfirmed.clear();
  failAwaiting(peer.awaitingAnswer, kind, why);
  failAwaiting(peer.awaitingData, kind, why);
  if (peer.reading && peer.link) {
    peer.link->abandonRead();
  }
  peer.reading = false;
  for (auto& read : peer.reads) {
    read.op->fail(kind, why);
  }
  peer.reads.clear();
  failQueued(peer.posted, kind, why);
  if (peer.target) {
    peer.target->fail(kind, why);
    peer.target.reset();
    peer.discard = true;
  }
}

void MessageTransport::peerVanished(int rank, const std::string& why) {
  Peer& gone = *peers_[rank];
  if (!gone.failure.empty()) {
    return;
  }
  if (!awaitingReason_) {
    awaitingReason_ = true;
    gone.broke = true;
    const Deadline until = Clock::now() + kReasonGrace;
    while (failure_.empty() && abortReason_.empty() && Clock::now() < until) {
      bool listening = false;
      for (size_t i = 0; i < used_.size(); ++i) {
        Peer& other = *used_[i];
        if (&other != &gone && other.link && other.failure.empty()) {
          listening = true;
          tryRecv(other);
        }
      }
      if (!listening || !failure_.empty()) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    awaitingReason_ = false;
  }
  failPeer(rank, why);
}

void MessageTransport::failPeer(int rank, const std::string& why) {
  if (!peers_[rank]->failure.empty()) {
    return;
  }
  if (failure_.empty()) {
    failure_ = why;
  }
  peers_[rank]->broke = true;
  // A group with a dead member cannot finish any collective: every pending request fails and
  // names it, including those with live peers (which may wait on something the dead rank owed),
  // and every peer is marked failed, so no request touches a buffer afterwards.
  for (auto& other : peers_) {
    if (other) {
      failPending(*other, CommError::Kind::kPeer, why);
      other->failure = why;
    }
  }
  failQueued(anyPeerReceives_, CommError::Kind::kPeer, why);
  progressed_.notify_all();
}

void MessageTransport::peerLeft(int rank, const std::string& why) {
  Peer& peer = *peers_[rank];
  if (!peer.failure.empty()) {
    return;
  }
  peer.failure = why;
  peer.broke = true;
  failPending(peer, CommError::Kind::kPeer, why);
}

const std::string& MessageTransport::peerFailure(int peer) const {
  return peers_[peer]->failure;
}

std::string MessageTransport::restOfFrame(int rank) const {
  const Peer& peer = *peers_[rank];
  if (peer.headSent == 0) {
    return peer.rest;
  }
  const Frame& frame = peer.sends.front();
  std::string rest;
  rest.reserve(sizeof(WireHeader) + frame.payloadBytes - peer.headSent);
  if (peer.headSent < sizeof(WireHeader)) {
    rest.append(reinterpret_cast<const char*>(&frame.header) + peer.headSent, sizeof(WireHeader) - peer.headSent);
    rest.append(frame.payload, frame.payloadBytes);
  } else {
    const size_t offset = peer.headSent - sizeof(WireHeader);
    rest.append(frame.payload + offset, frame.payloadBytes - offset);
  }
  return rest;
}

bool MessageTransport::canTell(int peer) const {
  return !peers_[peer]->broke;
}

bool MessageTransport::failDisagreeing(int sender, uint64_t tag, const CallSignature& call) {
  bool failed = false;
  for (Peer* peer : used_) {
    failed |= failDisagreeingIn(peer->posted, sender, tag, call);
  }
  return failDisagreeingIn(anyPeerReceives_, sender, tag, call) || failed;
}

void MessageTransport::abort(const std::string& why) {
  abortRequested();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!abortReason_.empty()) {
    return;
  }
  abortReason_ = why;
  announceAbort(why);
  for (auto& peer : peers_) {
    if (peer) {
      failPending(*peer, CommError::Kind::kAborted, why);
      peer->failure = why;
    }
  }
  failQueued(anyPeerReceives_, CommError::Kind::kAborted, why);
  wakeSleeper();
  progressed_.notify_all();
}

} // namespace torus
