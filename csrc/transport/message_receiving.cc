// The message layer's receiving side: frames read from each peer's Link, headers checked, eager
// payloads held or landed, ready-to-sends answered or read by RMA, receives matched to what arrived.
#include <algorithm>
#include <cstring>

#include "transport/message_transport_impl.h"

namespace torus {

namespace {

// Discarded payload (a message whose receive failed) is read through a buffer this large.
constexpr size_t kDiscardBytes = 64 * 1024;

size_t payloadBytes(const WireHeader& header) {
  switch (header.kind) {
    case kEagerFrame:
    case kDataFrame:
    case kFaultFrame:
    case kUnreadFrame:
      return header.nbytes;
    default:
      return 0;
  }
}

// Ready-to-sends a rank holds for one peer, for receives it has not posted: a header each (about
// 100 bytes), so a peer cannot make a rank hold without end; a program that runs this many sends
// ahead of its receives to one peer is told so, naming the peer.
constexpr size_t kMaxHeldAnnouncements = size_t{1} << 16;

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
    Frame answer;
    answer.header.sequence = read.header.sequence;
    answer.header.kind = kDoneFrame;
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
      // The sender's send fails too: its buffer may have gone (freed while the send ran).
      answer.header.kind = kUnreadFrame;
      answer.text = std::string(e.what()).substr(0, kFaultTextBytes);
      answer.header.nbytes = answer.text.size();
    }
    peer.reading = false;
    peer.reads.pop_front();
    queue(peer, std::move(answer));
    finished = true;
  }
  return finished;
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
      if (header.sequence > static_cast<uint64_t>(Departure::kProcessEnded)) {
        return brokeProtocol(peer, "a goodbye of unknown kind " + std::to_string(header.sequence));
      }
      peer.left = true;
      peer.departure = static_cast<Departure>(header.sequence);
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
    case kUnreadFrame: {
      auto it = peer.awaitingAnswer.find(header.sequence);
      if (it == peer.awaitingAnswer.end() || !it->second->loan) {
        return brokeProtocol(peer, "an unread for send #" + std::to_string(header.sequence) +
                                       ", which it was lent no buffer of to read");
      }
      if (header.nbytes > kFaultTextBytes) {
        return brokeProtocol(peer, "an unread for send #" + std::to_string(header.sequence) + " whose reason has " +
                                       std::to_string(header.nbytes) + " bytes, above the " +
                                       std::to_string(kFaultTextBytes) + " a reason may have");
      }
      peer.holding.resize(header.nbytes);
      break;
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
  if (header.kind == kUnreadFrame) {
    auto it = peer.awaitingAnswer.find(header.sequence);
    Op& send = *it->second;
    endLoan(peer, send);
    send.fail(CommError::Kind::kPeer, rankName(peer.rank) + " could not read this rank's buffer (a send of " +
                                          std::to_string(send.nbytes) + " bytes): " +
                                          std::string(peer.holding.begin(), peer.holding.end()));
    peer.awaitingAnswer.erase(it);
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

void MessageTransport::readOutOfTurn(Peer& peer) {
  // Requests this read completes may belong to a thread asleep in progress or in waitFor.
  if (tryRecv(peer)) {
    if (progressing_) {
      wakeSleeper();
    }
    progressed_.notify_all();
  }
}

} // namespace torus
