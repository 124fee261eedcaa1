// What the message layer's three files share (message_transport.cc: calls, frames out, progress;
// message_receiving.cc: frames in, matched to receives; message_failures.cc: peers that fail or
// leave, and abort): the state the layer keeps per peer and per operation. Private to
// csrc/transport/; the design is in message_transport.h.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport/departure.h"
#include "transport/message_transport.h"

namespace torus {

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
  // The payload of a frame of the layer's own that carries a text (unread): queue() points
  // `payload` at it once the frame has its place in the queue, where it stays until written.
  std::string text;
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
  // The peer said goodbye: it destroyed its group or its process ended, so the end of its stream
  // is no failure; `departure` says which.
  bool left = false;
  Departure departure = Departure::kGroupDestroyed;
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

} // namespace torus
