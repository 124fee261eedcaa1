#include "transport/message_transport.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace torus {

namespace {

// Discarded payload (a message whose receive failed) is read through a buffer this large.
constexpr size_t kDiscardBytes = 64 * 1024;

size_t payloadBytes(const WireHeader& header) {
  switch (header.kind) {
    case kEagerFrame:
    case kDataFrame:
    case kFaultFrame:
      return header.nbytes;
    default:
      return 0;
  }
}

// How long a peer that vanished without a word waits for another peer's reason (peerVanished):
// enough for a peer on a busy host to read a fault frame, give up and say so.
constexpr auto kReasonGrace = std::chrono::milliseconds(200);
// Ready-to-sends a rank holds for one peer, for receives it has not posted: a header each (about
// 100 bytes), so a peer cannot make a rank hold without end; a program that runs this many sends
// ahead of its receives to one peer is told so, naming the peer.
constexpr size_t kMaxHeldAnnouncements = size_t{1} << 16;

} // namespace

struct MessageTransport::Op : PendingOp {
  // A send whose payload the peer's Link reads: the key its own Link lent it with.
  std::optional<uint64_t> loan;
};

// A frame waiting to go out, with the send it carries or announces (none for the layer's own).
struct MessageTransport::Frame {
  WireHeader header;
  std::shared_ptr<Op> op;
  const char* payload = nullptr;
  size_t payloadBytes = 0;
};

// A message nobody has asked for yet: an eager one with its payload, or a ready-to-send header.
struct MessageTransport::Held {
  WireHeader header;
  std::vector<char> payload;
};

struct MessageTransport::Peer {
  int rank = -1;
  Link* link = nullptr; // null until the transport attaches one
  bool used = false; // in used_
  std::string failure;
  // The peer said goodbye: it destroyed its group, so the end of its stream is no failure.
  bool left = false;
  // The peer itself failed (it died, its stream broke, it gave up) or left: nothing more can be
  // told to it. Other peers of a failed group are failed but can still hear why.
  bool broke = false;
  // A frame to the peer was cut off partly written: the layer sends nothing more on its stream.
  bool cut = false;
  // The unwritten rest of the frame that was cut off, while the peer can still hear: written
  // out first, a peer told why the group failed reads a whole frame before the reason.
  std::string rest;

  // Sending: frames go out in order; the head may be partly written.
  std::deque<Frame> sends;
  // A write to the peer failed: nothing more is written while what it sent is read.
  bool writeFailed = false;
  size_t headSent = 0;
  // Bytes written to the Link, in all, and the sends written whole whose last byte (at that
  // offset) the Link has not yet handed on for good (Link::sentBytes).
  uint64_t written = 0;
  std::deque<std::pair<uint64_t, std::shared_ptr<Op>>> unconfirmed;
  uint64_t nextSequence = 0;
  // Ready-to-send sends, until the answer (clear-to-send or done) comes, by sequence.
  std::unordered_map<uint64_t, std::shared_ptr<Op>> awaitingAnswer;
  // Eager bytes sent that the peer has not credited back.
  size_t eagerInFlight = 0;

  // Receiving: a header, then its payload into `target` (a receive), `holding` (nobody asked
  // for it yet) or nowhere (`discard`).
  WireHeader header;
  size_t headerRead = 0;
  bool inPayload = false;
  size_t payloadRead = 0;
  std::shared_ptr<Op> target;
  bool discard = false;
  std::vector<char> holding;
  // Receives this rank cleared the peer to send to, by the send's sequence.
  std::unordered_map<uint64_t, std::shared_ptr<Op>> awaitingData;
  // Receives that read the peer's lent memory, in the order announced; the first is under way
  // once `reading`. Each is answered with a done when its read ends.
  struct Read {
    std::shared_ptr<Op> op;
    WireHeader header;
  };
  std::deque<Read> reads;
  bool reading = false;
  // The sequence of the last ready-to-send the peer announced: each is the one after.
  uint64_t announced = 0;
  // Ready-to-sends held in `arrived`: at most kMaxHeldAnnouncements.
  size_t heldAnnouncements = 0;
  // Eager payload received and not yet credited back (held, being read, or owed): the peer sent
  // it within its window, so it is at most eagerWindowBytes.
  size_t eagerUncredited = 0;
  // Eager payload consumed but not yet credited back.
  size_t creditOwed = 0;

  std::map<uint64_t, std::deque<std::shared_ptr<Op>>> posted;
  std::map<uint64_t, std::deque<Held>> arrived;
  // The last collective this rank sent the peer a probe about.
  uint64_t probedTag = UINT64_MAX;
};

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

namespace {

// Removes and returns the oldest entry of `tag` in `queues` (first-in first-out per tag).
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

std::shared_ptr<MessageTransport::Op> MessageTransport::matchPosted(Peer& peer, uint64_t tag) {
  // The oldest receive posted for this sender, else the oldest posted for any peer.
  for (auto* queues : {&peer.posted, &anyPeerReceives_}) {
    if (auto op = popOldest(*queues, tag)) {
      (*op)->peerRank = peer.rank;
      return *op;
    }
  }
  return nullptr;
}

bool MessageTransport::takeHeld(Peer& peer, const std::shared_ptr<Op>& op) {
  auto held = popOldest(peer.arrived, op->tag);
  if (!held) {
    return false;
  }
  op->peerRank = peer.rank;
  const bool accepted = op->accepts(peer.rank, held->header.call, held->header.nbytes);
  if (held->header.kind == kReadyToSendFrame) {
    --peer.heldAnnouncements;
    answerReadyToSend(peer, op, held->header, accepted);
    return true;
  }
  if (accepted) {
    std::memcpy(op->buf, held->payload.data(), held->payload.size());
    op->complete = true;
  }
  credit(peer, held->payload.size());
  return true;
}

void MessageTransport::answerReadyToSend(Peer& peer, const std::shared_ptr<Op>& op, const WireHeader& header,
                                         bool accepted) {
  if (accepted && header.address != 0) {
    // Read on later passes (advanceReads), never waited for here: the caller holds the lock.
    peer.reads.push_back({op, header});
    advanceReads(peer);
    return;
  }
  Frame answer;
  answer.header.sequence = header.sequence;
  answer.header.kind = kDoneFrame;
  if (accepted) {
    peer.awaitingData[header.sequence] = op;
    answer.header.kind = kClearToSendFrame;
  }
  queue(peer, std::move(answer));
}

bool MessageTransport::advanceReads(Peer& peer) {
  bool finished = false;
  while (!peer.reads.empty() && peer.failure.empty()) {
    Peer::Read& read = peer.reads.front();
    try {
      if (!peer.reading) {
        peer.link->startRead(read.header.address, read.header.key, static_cast<char*>(read.op->buf),
                             read.op->nbytes);
        peer.reading = true;
      }
      if (!peer.link->continueRead()) {
        return finished;
      }
      read.op->complete = true;
    } catch (const CommError& e) {
      read.op->fail(e.kind(), e.what());
    }
    peer.reading = false;
    Frame answer;
    answer.header.sequence = read.header.sequence;
    answer.header.kind = kDoneFrame;
    peer.reads.pop_front();
    queue(peer, std::move(answer));
    finished = true;
  }
  return finished;
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

bool MessageTransport::tryRecv(Peer& peer) {
  static thread_local std::vector<char> discarded(kDiscardBytes);
  bool completed = false;
  bool readAny = false;
  while (peer.link && peer.failure.empty()) {
    char* dst;
    size_t want;
    if (!peer.inPayload) {
      dst = reinterpret_cast<char*>(&peer.header) + peer.headerRead;
      want = sizeof(WireHeader) - peer.headerRead;
    } else if (peer.discard) {
      dst = discarded.data();
      want = std::min(kDiscardBytes, payloadBytes(peer.header) - peer.payloadRead);
    } else {
      dst = (peer.target ? peer.target->buf : peer.holding.data()) + peer.payloadRead;
      want = payloadBytes(peer.header) - peer.payloadRead;
    }
    ssize_t got = 0;
    try {
      got = peer.link->read(dst, want);
    } catch (const CommError& e) {
      peerVanished(peer.rank, e.what());
      return true;
    }
    if (got < 0) {
      peerClosed(peer);
      return true;
    }
    if (got == 0) {
      break;
    }
    readAny = true;
    if (!peer.inPayload) {
      peer.headerRead += static_cast<size_t>(got);
      if (peer.headerRead == sizeof(WireHeader)) {
        peer.headerRead = 0;
        completed |= onHeader(peer);
      }
    } else {
      peer.payloadRead += static_cast<size_t>(got);
      if (peer.payloadRead == payloadBytes(peer.header)) {
        peer.inPayload = false;
        completed |= onPayload(peer);
      }
    }
  }
  if (readAny) {
    peer.link->consumed();
  }
  return completed;
}

bool MessageTransport::onHeader(Peer& peer) {
  const WireHeader& header = peer.header;
  bool completed = false;
  peer.target.reset();
  peer.discard = false;
  if (peer.left) {
    return brokeProtocol(peer, "a frame of kind " + std::to_string(header.kind) + " after its goodbye");
  }
  switch (header.kind) {
    case kGoodbyeFrame:
      peer.left = true;
      return false;
    case kProbeFrame:
      return failDisagreeing(peer.rank, header.sequence, header.call);
    case kCreditFrame:
      if (header.sequence > peer.eagerInFlight) {
        return brokeProtocol(peer, "a credit of " + std::to_string(header.sequence) + " eager bytes where " +
                                       std::to_string(peer.eagerInFlight) + " were outstanding");
      }
      peer.eagerInFlight -= header.sequence;
      return false;
    case kClearToSendFrame: {
      auto it = peer.awaitingAnswer.find(header.sequence);
      if (it == peer.awaitingAnswer.end()) {
        return brokeProtocol(peer, "a clear-to-send for send #" + std::to_string(header.sequence) +
                                       ", which waits for no answer");
      }
      Frame data;
      data.op = std::move(it->second);
      peer.awaitingAnswer.erase(it);
      data.header = WireHeader{data.op->tag, data.op->nbytes, header.sequence, 0, data.op->call, kDataFrame};
      data.payload = data.op->buf;
      data.payloadBytes = data.op->nbytes;
      queue(peer, std::move(data));
      return false;
    }
    case kDoneFrame: {
      auto it = peer.awaitingAnswer.find(header.sequence);
      if (it == peer.awaitingAnswer.end()) {
        return brokeProtocol(peer, "a done for send #" + std::to_string(header.sequence) + ", which waits for no answer");
      }
      endLoan(peer, *it->second);
      it->second->complete = true;
      peer.awaitingAnswer.erase(it);
      return true;
    }
    case kReadyToSendFrame: {
      if (header.sequence != peer.announced + 1) {
        return brokeProtocol(peer, "a ready-to-send numbered " + std::to_string(header.sequence) + " where #" +
                                       std::to_string(peer.announced + 1) + " was next (tag " +
                                       std::to_string(header.tag) + ")");
      }
      peer.announced = header.sequence;
      auto op = matchPosted(peer, header.tag);
      if (!op) {
        if (peer.heldAnnouncements == kMaxHeldAnnouncements) {
          return brokeProtocol(peer, "a ready-to-send (#" + std::to_string(header.sequence) + ", tag " +
                                         std::to_string(header.tag) + ") with " +
                                         std::to_string(kMaxHeldAnnouncements) +
                                         " of its sends already waiting for receives this rank has not posted, the "
                                         "most a rank holds for one peer");
        }
        ++peer.heldAnnouncements;
        peer.arrived[header.tag].push_back(Held{header, {}});
        return false;
      }
      answerReadyToSend(peer, op, header, op->accepts(peer.rank, header.call, header.nbytes));
      return op->complete;
    }
    case kDataFrame: {
      // Its payload goes straight into the receive's buffer: it must be the very message that
      // receive accepted.
      auto it = peer.awaitingData.find(header.sequence);
      if (it == peer.awaitingData.end()) {
        return brokeProtocol(peer, "a data frame of " + std::to_string(header.nbytes) + " bytes for send #" +
                                       std::to_string(header.sequence) + ", which this rank did not clear to send (tag " +
                                       std::to_string(header.tag) + ")");
      }
      const Op& receive = *it->second;
      if (header.nbytes != receive.nbytes || header.tag != receive.tag) {
        return brokeProtocol(peer, "a data frame of " + std::to_string(header.nbytes) + " bytes (tag " +
                                       std::to_string(header.tag) + ") for a receive of " +
                                       std::to_string(receive.nbytes) + " bytes (tag " + std::to_string(receive.tag) +
                                       ")");
      }
      peer.target = std::move(it->second);
      peer.awaitingData.erase(it);
      break;
    }
    case kEagerFrame:
      // Held or discarded, its payload stays within what the peer's window lets it send unasked.
      if (header.nbytes > options_.eagerBytes) {
        return brokeProtocol(peer, "an eager frame of " + std::to_string(header.nbytes) +
                                       " bytes, above the eager limit of " + std::to_string(options_.eagerBytes) +
                                       " bytes (TORUS_EAGER_BYTES must be the same on every rank) (tag " +
                                       std::to_string(header.tag) + ")");
      }
      if (header.nbytes > options_.eagerWindowBytes - peer.eagerUncredited) {
        return brokeProtocol(peer, "an eager frame of " + std::to_string(header.nbytes) + " bytes with " +
                                       std::to_string(peer.eagerUncredited) +
                                       " eager bytes not yet credited back, past the eager window of " +
                                       std::to_string(options_.eagerWindowBytes) +
                                       " bytes (TORUS_EAGER_WINDOW must be the same on every rank) (tag " +
                                       std::to_string(header.tag) + ")");
      }
      peer.eagerUncredited += header.nbytes;
      peer.target = matchPosted(peer, header.tag);
      if (peer.target && !peer.target->accepts(peer.rank, header.call, header.nbytes)) {
        peer.target.reset();
        peer.discard = true;
        completed = true;
      } else if (!peer.target) {
        peer.holding.resize(header.nbytes);
      }
      break;
    case kFaultFrame:
      if (peer.header.nbytes > kFaultTextBytes) {
        failPeer(peer.rank, rankName(peer.rank) + " gave up on the group (its reason, of " +
                                std::to_string(peer.header.nbytes) + " bytes, was too long to read)");
        return true;
      }
      peer.holding.resize(header.nbytes);
      break;
    default:
      return brokeProtocol(peer, "a frame of unknown kind " + std::to_string(header.kind) +
                                     " (the ranks may run different versions of torch_torus)");
  }
  peer.payloadRead = 0;
  if (payloadBytes(header) > 0) {
    peer.inPayload = true;
    return completed;
  }
  return onPayload(peer) || completed;
}

bool MessageTransport::onPayload(Peer& peer) {
  const WireHeader& header = peer.header;
  if (header.kind == kFaultFrame) {
    failPeer(peer.rank, rankName(peer.rank) + " gave up on the group: " +
                            std::string(peer.holding.begin(), peer.holding.end()));
    return true;
  }
  if (peer.target) {
    peer.target->complete = true;
    peer.target.reset();
    if (header.kind == kEagerFrame) {
      credit(peer, header.nbytes);
    }
    return true;
  }
  if (peer.discard) {
    peer.discard = false;
    if (header.kind == kEagerFrame) {
      credit(peer, header.nbytes);
    }
    return false;
  }
  // Held: a receive may have been posted while the payload was being read.
  Held held{header, std::move(peer.holding)};
  peer.holding = {};
  auto late = matchPosted(peer, header.tag);
  if (!late) {
    peer.arrived[header.tag].push_back(std::move(held));
    return false;
  }
  if (late->accepts(peer.rank, header.call, header.nbytes)) {
    std::memcpy(late->buf, held.payload.data(), held.payload.size());
    late->complete = true;
  }
  credit(peer, held.payload.size());
  return true;
}

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
    peerLeft(peer.rank, rankName(peer.rank) + " left the group (destroyed its process group)");
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

bool MessageTransport::wantsToWrite(int peer) const {
  return !peers_[peer]->sends.empty();
}

bool MessageTransport::betweenFrames(int peer) const {
  return peers_[peer]->headSent == 0 && !peers_[peer]->cut;
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

void MessageTransport::readOutOfTurn(Peer& peer) {
  // Requests this read completes may belong to a thread asleep in progress or in waitFor.
  if (tryRecv(peer)) {
    if (progressing_) {
      wakeSleeper();
    }
    progressed_.notify_all();
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
