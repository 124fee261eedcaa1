// The message layer (message_transport.h): its frames, its peers attached to their Links, isend and
// irecv, frames written out in order, sends confirmed, the checks on calls held and waits probed,
// and the progress loop. Frames read in are in message_receiving.cc, failures in
// message_failures.cc.
#include "transport/message_transport.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "transport/message_transport_impl.h"

namespace torus {

void Link::startRead(uint64_t address, uint64_t key, char* dst, size_t n) {
  throw CommError(CommError::Kind::kPeer, "this link cannot read the peer's memory");
}

MessageTransport::MessageTransport(int rank, int size, MessageOptions options)
    : rank_(rank), size_(size), options_(options), peers_(static_cast<size_t>(size)) {}

MessageTransport::~MessageTransport() = default;

std::string MessageTransport::ownFrame(FrameKind kind, const std::string& text) {
  WireHeader header;
  header.kind = kind;
  header.nbytes = text.size();
  return std::string(reinterpret_cast<const char*>(&header), sizeof(header)) + text;
}

std::string MessageTransport::goodbyeFrame() {
  WireHeader header;
  header.kind = kGoodbyeFrame;
  header.sequence = static_cast<uint64_t>(currentDeparture());
  return std::string(reinterpret_cast<const char*>(&header), sizeof(header));
}

std::string MessageTransport::faultFrame(const std::string& why) {
  return ownFrame(kFaultFrame, why.substr(0, kFaultTextBytes));
}

void MessageTransport::addPeer(int peer) {
  peers_[peer] = std::make_unique<Peer>();
  peers_[peer]->rank = peer;
}

void MessageTransport::attach(int peer, Link* link) {
  if (!peers_[peer]) {
    addPeer(peer);
  }
  Peer& p = *peers_[peer];
  p.link = link;
  if (!p.used) {
    p.used = true;
    used_.push_back(&p);
  }
}

MessageTransport::Peer& MessageTransport::linkedPeer(int rank) {
  Peer& peer = *peers_[rank];
  if (!peer.used) {
    peer.used = true;
    used_.push_back(&peer);
  }
  if (!peer.link && peer.failure.empty() && abortReason_.empty()) {
    wantLink(rank);
  }
  return peer;
}

RequestPtr MessageTransport::isend(int peer, uint64_t tag, const CallSignature& call, const void* buf,
                                   size_t nbytes) {
  if (peer < 0 || peer >= size_ || peer == rank_ || !peers_[peer]) {
    throw std::invalid_argument("torus: invalid send peer " + std::to_string(peer));
  }
  auto op = makeOp<Op>(this, true, peer, tag, call, buf, nbytes);
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& p = linkedPeer(peer);
  if (!abortReason_.empty()) {
    op->fail(CommError::Kind::kAborted, abortReason_);
    return op;
  }
  if (!p.failure.empty()) {
    op->fail(CommError::Kind::kPeer, p.failure);
    return op;
  }
  Frame frame;
  frame.op = op;
  frame.header.tag = tag;
  frame.header.nbytes = nbytes;
  frame.header.call = call;
  // Links attached later (TCP's) never read the peer's memory.
  const size_t peerReadsAbove = p.link ? p.link->peerReadsAbove() : SIZE_MAX;
  if (nbytes <= options_.eagerBytes && nbytes <= peerReadsAbove && p.eagerInFlight + nbytes <= options_.eagerWindowBytes) {
    frame.header.kind = kEagerFrame;
    frame.payload = op->buf;
    frame.payloadBytes = nbytes;
    p.eagerInFlight += nbytes;
  } else {
    frame.header.kind = kReadyToSendFrame;
    frame.header.sequence = ++p.nextSequence;
    if (nbytes > peerReadsAbove) {
      try {
        frame.header.key = p.link->lend(buf, nbytes);
        frame.header.address = reinterpret_cast<uint64_t>(buf);
        op->loan = frame.header.key;
      } catch (const CommError& e) {
        op->fail(e.kind(), e.what());
        return op;
      }
    }
  }
  queue(p, std::move(frame));
  return op;
}

RequestPtr MessageTransport::irecv(int peer, uint64_t tag, const CallSignature& call, void* buf, size_t nbytes) {
  if (peer != kAnyPeer && (peer < 0 || peer >= size_ || peer == rank_ || !peers_[peer])) {
    throw std::invalid_argument("torus: invalid receive peer " + std::to_string(peer));
  }
  auto op = makeOp<Op>(this, false, peer, tag, call, buf, nbytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!abortReason_.empty()) {
    op->fail(CommError::Kind::kAborted, abortReason_);
    return op;
  }
  if (peer == kAnyPeer) {
    // By index: a read of the peer's memory (takeHeld) may attach Links, which grows used_.
    for (size_t i = 0; i < used_.size(); ++i) {
      if (takeHeld(*used_[i], op)) {
        return op;
      }
    }
    anyPeerReceives_[tag].push_back(op);
    return op;
  }
  Peer& p = linkedPeer(peer);
  if (takeHeld(p, op)) {
    return op;
  }
  if (!p.failure.empty()) {
    op->fail(CommError::Kind::kPeer, p.failure);
    return op;
  }
  p.posted[tag].push_back(op);
  return op;
}

void MessageTransport::credit(Peer& peer, size_t nbytes) {
  peer.creditOwed += nbytes;
  if (peer.creditOwed == 0 || peer.creditOwed < std::max<size_t>(1, options_.eagerWindowBytes / 4)) {
    return;
  }
  Frame frame;
  frame.header.kind = kCreditFrame;
  frame.header.sequence = peer.creditOwed;
  peer.eagerUncredited -= peer.creditOwed;
  peer.creditOwed = 0;
  queue(peer, std::move(frame));
}

void MessageTransport::queue(Peer& peer, Frame frame) {
  peer.sends.push_back(std::move(frame));
  Frame& queued = peer.sends.back();
  if (!queued.text.empty()) {
    queued.payload = queued.text.data();
    queued.payloadBytes = queued.text.size();
  }
  if (peer.sends.size() == 1) {
    trySend(peer);
  }
  if (!peer.sends.empty() && progressing_) {
    wakeSleeper(); // the sleeping thread must watch this Link for room
  }
}

bool MessageTransport::trySend(Peer& peer) {
  bool wrote = false;
  while (peer.link && !peer.sends.empty() && peer.failure.empty() && !peer.writeFailed) {
    Frame& frame = peer.sends.front();
    iovec parts[2];
    int count = 0;
    if (peer.headSent < sizeof(WireHeader)) {
      parts[count++] = {reinterpret_cast<char*>(&frame.header) + peer.headSent, sizeof(WireHeader) - peer.headSent};
      if (frame.payloadBytes > 0) {
        parts[count++] = {const_cast<char*>(frame.payload), frame.payloadBytes};
      }
    } else {
      const size_t offset = peer.headSent - sizeof(WireHeader);
      parts[count++] = {const_cast<char*>(frame.payload) + offset, frame.payloadBytes - offset};
    }
    size_t took = 0;
    try {
      took = peer.link->write(parts, count);
    } catch (const CommError& e) {
      // The peer's last words (a fault or goodbye frame) may wait unread, and they say better
      // why its stream broke; failPeer does nothing once they have failed the peer.
      peer.writeFailed = true;
      tryRecv(peer);
      peerVanished(peer.rank, e.what());
      return true;
    }
    if (took == 0) {
      break;
    }
    wrote = true;
    peer.written += took;
    peer.headSent += took;
    if (peer.headSent < sizeof(WireHeader) + frame.payloadBytes) {
      continue;
    }
    peer.headSent = 0;
    Frame sent = std::move(peer.sends.front());
    peer.sends.pop_front();
    if (sent.header.kind == kEagerFrame || sent.header.kind == kDataFrame) {
      peer.unconfirmed.emplace_back(peer.written, std::move(sent.op));
    } else if (sent.header.kind == kReadyToSendFrame) {
      peer.awaitingAnswer[sent.header.sequence] = std::move(sent.op);
    }
  }
  if (wrote) {
    peer.link->flush();
  }
  return confirmSends(peer);
}

bool MessageTransport::confirmSends(Peer& peer) {
  if (peer.unconfirmed.empty()) {
    return false;
  }
  const uint64_t sent = peer.link->sentBytes();
  bool completed = false;
  while (!peer.unconfirmed.empty() && peer.unconfirmed.front().first <= sent) {
    peer.unconfirmed.front().second->complete = true;
    peer.unconfirmed.pop_front();
    completed = true;
  }
  return completed;
}

bool MessageTransport::wantsToWrite(int peer) const {
  return !peers_[peer]->sends.empty();
}

bool MessageTransport::betweenFrames(int peer) const {
  return peers_[peer]->headSent == 0 && !peers_[peer]->cut;
}

void MessageTransport::checkHeldCalls() {
  // A message nobody has asked for, of a call that disagrees with a receive posted for the same
  // collective from another rank: the two ranks called different collectives (or the same one
  // with different peers), which no first message between them shows.
  for (Peer* sender : used_) {
    for (auto& [tag, held] : sender->arrived) {
      failDisagreeing(sender->rank, tag, held.front().header.call);
    }
  }
}

void MessageTransport::probeWaits() {
  // Ranks that disagree on a collective but exchange no message at all would otherwise wait out
  // their timeouts: tell each peer waited on which collective this rank waits in, once each.
  // By index: a write that fails reads what the peer sent, which may attach Links (used_ grows).
  for (size_t i = 0; i < used_.size(); ++i) {
    Peer* peer = used_[i];
    if (!peer->failure.empty()) {
      continue;
    }
    std::vector<Frame> probes;
    for (auto& [tag, ops] : peer->posted) {
      const CallSignature& call = ops.front()->call;
      if (call.kind == 0 || peer->probedTag == tag) {
        continue;
      }
      peer->probedTag = tag;
      Frame probe;
      probe.header.kind = kProbeFrame;
      probe.header.sequence = tag;
      probe.header.call = call;
      probes.push_back(probe);
    }
    for (auto& probe : probes) {
      queue(*peer, std::move(probe));
    }
  }
}

std::optional<CallSignature> MessageTransport::arrivedCall(int rank, uint64_t tag) {
  Peer& peer = *peers_[rank];
  readOutOfTurn(peer);
  auto held = peer.arrived.find(tag);
  if (held != peer.arrived.end()) {
    return held->second.front().header.call;
  }
  return std::nullopt;
}

std::optional<Transport::StrayMessage> MessageTransport::strayMessage(uint64_t upToTag) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (readsCheaply()) {
    // By index: a read may attach Links (a ready-to-send read from the peer's memory makes
    // progress, which may answer another peer's hello), which grows used_.
    for (size_t i = 0; i < used_.size(); ++i) {
      if (used_[i]->failure.empty()) {
        readOutOfTurn(*used_[i]);
      }
    }
  }
  for (Peer* peer : used_) {
    if (!peer->arrived.empty() && peer->arrived.begin()->first <= upToTag) {
      return StrayMessage{peer->rank, peer->arrived.begin()->first, peer->arrived.begin()->second.front().header.call};
    }
  }
  return std::nullopt;
}

bool MessageTransport::hasPending() const {
  if (!anyPeerReceives_.empty() || hasOwnWork()) {
    return true;
  }
  for (const Peer* peer : used_) {
    if (peer->failure.empty() &&
        (!peer->sends.empty() || !peer->unconfirmed.empty() || !peer->awaitingAnswer.empty() ||
         !peer->awaitingData.empty() || !peer->reads.empty() ||
         !peer->posted.empty() || peer->target)) {
      return true;
    }
  }
  return false;
}

bool MessageTransport::tryPeer(int rank) {
  Peer& peer = *peers_[rank];
  if (!peer.link || !peer.failure.empty()) {
    return false;
  }
  bool moved = tryRecv(peer);
  moved |= advanceReads(peer);
  return trySend(peer) || moved;
}

bool MessageTransport::tryAll() {
  bool moved = checkPeers();
  for (size_t i = 0; i < used_.size(); ++i) { // checkPeers and tryPeer may attach Links
    moved |= tryPeer(used_[i]->rank);
  }
  return moved;
}

void MessageTransport::progress(std::unique_lock<std::mutex>& lock, Deadline deadline) {
  if (spinBriefly(lock)) {
    return;
  }
  if (!sleep(lock, deadline)) {
    checkHeldCalls();
    whenIdle();
    probeWaits();
  }
}

} // namespace torus
