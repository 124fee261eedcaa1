// OfiTransport::Stream's work: chunks filled, sealed and posted against the peer's credits, slots
// reposted and credits returned, reads of what arrived, the peer's end and farewell, loans and RMA
// reads of the peer's memory.
#include "transport/ofi/ofi_stream.h"

#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#include <algorithm>
#include <cstring>

namespace torus {

void OfiTransport::Stream::release() {
  for (auto& [key, loan] : loans) {
    transport->fabric_.deregister(loan);
  }
  loans.clear();
  if (reader) {
    transport->fabric_.deregister(reader->region);
  }
  for (auto& read : abandoned) {
    transport->fabric_.deregister(read->region);
  }
  transport->fabric_.deregister(region);
}

void OfiTransport::Stream::brokeProtocol(const std::string& what) {
  if (!lied) {
    lied = true;
    error = rankName(peer) + " broke the OFI transport's protocol: it sent " + what +
            "; this rank reads nothing more from it";
  }
}

void OfiTransport::Stream::checkFarewell() {
  const auto& farewell = transport->lifelines_.farewell(peer);
  if (!farewell || farewellChecked) {
    return;
  }
  farewellChecked = true;
  if (farewell->readBytes > postedBytes) {
    brokeProtocol("a farewell whose read count says it read " + std::to_string(farewell->readBytes) +
                  " bytes of this rank's stream, where " + std::to_string(postedBytes) + " were sent");
  } else if (farewell->streamBytes < readBytes) {
    brokeProtocol("a farewell whose stream count says it wrote " + std::to_string(farewell->streamBytes) +
                  " bytes, where this rank read " + std::to_string(readBytes));
  }
}

void OfiTransport::Stream::broke(const std::string& what, ssize_t result) {
  if (error.empty()) {
    error = "libfabric: " + what + " with " + rankName(peer) + " failed: " + ofi::errorText(static_cast<int>(-result));
  }
}

bool OfiTransport::Stream::taken(ssize_t result, const char* what) {
  if (result != 0 && result != -FI_EAGAIN) {
    broke(what, result);
  }
  return result == 0;
}

size_t OfiTransport::Stream::accept(const char* data, size_t n) {
  size_t took = 0;
  const uint64_t start = written;
  while (took < n) {
    if (chunks[fill] == Chunk::kFree) {
      chunks[fill] = Chunk::kFilling;
      chunkBytes[fill] = 0;
    }
    if (chunks[fill] != Chunk::kFilling) {
      break;
    }
    const size_t part = std::min(kChunkBytes - chunkBytes[fill], n - took);
    std::memcpy(chunk(fill) + chunkBytes[fill], data + took, part);
    chunkBytes[fill] += part;
    took += part;
    written = start + took;
    if (chunkBytes[fill] == kChunkBytes) {
      seal();
    }
  }
  return took;
}

void OfiTransport::Stream::seal() {
  chunkEnd[fill] = written;
  chunks[fill] = Chunk::kSealed;
  sealed.push_back(fill);
  fill = (fill + 1) % kSlots;
}

bool OfiTransport::Stream::postChunks() {
  bool sent = false;
  // Nothing before the hello, which waits for the lifeline's (Lifelines::helloSent).
  while (!sealed.empty() && credits > 0 && !helloToSend && error.empty() && !gone()) {
    const int i = sealed.front();
    if (!taken(fi_tsend(ep(), chunk(i), chunkBytes[i], desc, address, ownTag(kStreamTag), &chunkPosts[i]),
               "sending")) {
      break;
    }
    sealed.pop_front();
    --credits;
    postedBytes = chunkEnd[i];
    chunks[i] = Chunk::kPosted;
    inFlight.push_back(i);
    sent = true;
  }
  return sent;
}

bool OfiTransport::Stream::postSlot(int i) {
  return taken(fi_trecv(ep(), slot(i), kChunkBytes, desc, sender(), kStreamTag | static_cast<uint64_t>(peer), 0,
                        &slotPosts[i]),
               "posting a receive");
}

bool OfiTransport::Stream::postControlReceive() {
  if (controlReceivePosted || lied) {
    return true;
  }
  controlReceivePosted = taken(fi_trecv(ep(), &creditWords()[0], sizeof(uint64_t), desc, sender(),
                                        kControlTag | static_cast<uint64_t>(peer), 0, &controlReceivePost),
                               "posting a receive");
  return controlReceivePosted;
}

bool OfiTransport::Stream::sendCredits() {
  if (creditsToSend == 0 || controlSendBusy || !error.empty() || gone()) {
    return false;
  }
  creditWords()[1] = creditsToSend;
  if (!taken(fi_tsend(ep(), &creditWords()[1], sizeof(uint64_t), desc, address, ownTag(kControlTag),
                      &controlSendPost),
             "returning credits")) {
    return false;
  }
  controlSendBusy = true;
  creditsToSend = 0;
  return true;
}

bool OfiTransport::Stream::sendHello() {
  if (!helloToSend || helloBusy || !transport->lifelines_.helloSent(peer) || gone()) {
    return false;
  }
  if (!taken(fi_tsend(ep(), &hello(), sizeof(HelloMessage), desc, address, ownTag(kHelloTag), &helloPost),
             "saying hello")) {
    return false;
  }
  helloToSend = false;
  helloBusy = true;
  return true;
}

bool OfiTransport::Stream::repost() {
  bool posted = false;
  while (!toRepost.empty() && error.empty() && postSlot(toRepost.front())) {
    toRepost.pop_front();
    posted = true;
    if (firstPosts > 0) {
      --firstPosts;
    } else {
      ++owed;
    }
  }
  if (owed >= kCreditBatch) {
    creditsToSend += static_cast<uint64_t>(owed);
    owed = 0;
  }
  return posted;
}

bool OfiTransport::Stream::pump() {
  bool moved = sendHello();
  moved |= repost();
  moved |= !controlReceivePosted && postControlReceive();
  if (!farewell.empty()) {
    const size_t took = accept(farewell.data(), farewell.size());
    farewell.erase(0, took);
    if (chunks[fill] == Chunk::kFilling && chunkBytes[fill] > 0) {
      seal();
    }
    moved |= took > 0;
  }
  moved |= postChunks();
  moved |= sendCredits();
  return moved;
}

bool OfiTransport::Stream::sending() const {
  if (!error.empty()) {
    return false;
  }
  for (int i = 0; i < kSlots; ++i) {
    if (chunks[i] == Chunk::kSealed || chunks[i] == Chunk::kPosted) {
      return true;
    }
  }
  return !farewell.empty() || helloToSend || helloBusy || creditsToSend > 0 || controlSendBusy;
}

std::string OfiTransport::Stream::endedWhy() const {
  const ofi::Lifelines& lifelines = transport->lifelines_;
  const auto& farewell = lifelines.farewell(peer);
  if (!farewell) {
    return lifelines.endedWhy(peer);
  }
  return farewell->kind == ofi::Farewell::kFault ? rankName(peer) + " gave up on the group: " + farewell->why
                                                 : departureText(peer, peerDeparture());
}

ssize_t OfiTransport::Stream::broken() {
  if (lied) {
    throw CommError(CommError::Kind::kPeer, error);
  }
  if (transport->lifelines_.ended(peer)) {
    return atEnd();
  }
  if (errorSeen == Clock::time_point{}) {
    errorSeen = Clock::now();
  }
  if (Clock::now() - errorSeen < kFarewellGrace) {
    return 0;
  }
  throw CommError(CommError::Kind::kPeer, error);
}

size_t OfiTransport::Stream::write(const iovec* parts, int count) {
  if (transport->lifelines_.ended(peer)) {
    // Never post to a peer that may be gone: the shm provider spins forever on one. A peer
    // that left takes nothing more, which is no failure by itself (a credit it no longer
    // needs): the reads reach its goodbye, and what waits for the peer fails there.
    const auto& farewell = transport->lifelines_.farewell(peer);
    if (farewell && farewell->kind == ofi::Farewell::kGoodbye) {
      return 0;
    }
    throw CommError(CommError::Kind::kPeer, endedWhy());
  }
  if (!error.empty()) {
    broken();
    return 0;
  }
  size_t took = 0;
  for (int i = 0; i < count; ++i) {
    const size_t part = accept(static_cast<const char*>(parts[i].iov_base), parts[i].iov_len);
    took += part;
    if (part < parts[i].iov_len) {
      break;
    }
  }
  return took;
}

void OfiTransport::Stream::sent(int i) {
  sendDone[i] = true;
  while (!inFlight.empty() && sendDone[inFlight.front()]) {
    const int oldest = inFlight.front();
    inFlight.pop_front();
    sendDone[oldest] = false;
    handedOn = chunkEnd[oldest];
    chunks[oldest] = Chunk::kFree;
  }
}

uint64_t OfiTransport::Stream::sentBytes() const {
  const auto& farewell = transport->lifelines_.farewell(peer);
  return farewell && farewellChecked && !lied ? std::max(handedOn, farewell->readBytes) : handedOn;
}

void OfiTransport::Stream::flush() {
  if (chunks[fill] == Chunk::kFilling && chunkBytes[fill] > 0) {
    seal();
  }
  postChunks();
}

ssize_t OfiTransport::Stream::read(char* dst, size_t n) {
  if (lied) {
    throw CommError(CommError::Kind::kPeer, error);
  }
  // What arrived before an error (the peer's last chunks, a fault frame) is read first.
  size_t got = 0;
  while (got < n && filled[head]) {
    const size_t part = std::min(slotBytes[head] - headRead, n - got);
    std::memcpy(dst + got, slot(head) + headRead, part);
    got += part;
    headRead += part;
    if (headRead == slotBytes[head]) {
      filled[head] = false;
      headRead = 0;
      toRepost.push_back(head);
      head = (head + 1) % kSlots;
    }
  }
  readBytes += got;
  if (got > 0) {
    return static_cast<ssize_t>(got);
  }
  return error.empty() ? atEnd() : broken();
}

ssize_t OfiTransport::Stream::atEnd() {
  const ofi::Lifelines& lifelines = transport->lifelines_;
  if (!lifelines.ended(peer)) {
    return 0;
  }
  const auto& farewell = lifelines.farewell(peer);
  if (endSeen == Clock::time_point{}) {
    endSeen = Clock::now();
  }
  if (!farewell) {
    // Killed, or gone before its farewell could be written: a fault frame it sent may still
    // be on the fabric, and says better why.
    if (Clock::now() - endSeen < kFarewellGrace) {
      return 0;
    }
    throw CommError(CommError::Kind::kPeer, endedWhy());
  }
  if (readBytes >= farewell->streamBytes && farewell->kind == ofi::Farewell::kGoodbye) {
    return -1;
  }
  if (readBytes < farewell->streamBytes && Clock::now() - endSeen < kStreamEndGrace) {
    return 0;
  }
  throw CommError(CommError::Kind::kPeer,
                  farewell->kind == ofi::Farewell::kFault
                      ? endedWhy()
                      : rankName(peer) + " left the group, but " +
                            std::to_string(farewell->streamBytes - readBytes) + " bytes it sent never arrived");
}

void OfiTransport::Stream::consumed() {
  repost();
  sendCredits();
}

bool OfiTransport::Stream::peerSaidGoodbye() const {
  const auto& farewell = transport->lifelines_.farewell(peer);
  return farewell && farewell->kind == ofi::Farewell::kGoodbye;
}

Departure OfiTransport::Stream::peerDeparture() const {
  const auto& farewell = transport->lifelines_.farewell(peer);
  return farewell && farewell->why == ofi::goodbyeWhy(Departure::kProcessEnded) ? Departure::kProcessEnded
                                                                                : Departure::kGroupDestroyed;
}

size_t OfiTransport::Stream::peerReadsAbove() const {
  return transport->fabric_.offersRma() ? transport->rmaAbove_ : SIZE_MAX;
}

uint64_t OfiTransport::Stream::lend(const void* buf, size_t n) {
  ofi::Region loan;
  std::string why;
  if (!transport->fabric_.registerMemory(buf, n, FI_REMOTE_READ, &loan, &why)) {
    throw CommError(CommError::Kind::kPeer, "cannot lend a message of " + std::to_string(n) + " bytes to " +
                                                rankName(peer) + ": " + why);
  }
  loans[loan.key] = loan;
  return loan.key;
}

void OfiTransport::Stream::endLoan(uint64_t key) {
  auto it = loans.find(key);
  if (it != loans.end()) {
    transport->fabric_.deregister(it->second);
    loans.erase(it);
  }
}

void OfiTransport::Stream::startRead(uint64_t remote, uint64_t key, char* dst, size_t n) {
  // Never waited for: the message layer moves it on (continueRead) on every pass of its
  // progress loop, which releases the transport's lock between passes; the read's own deadline
  // is the group's timeout, and each step looks at the peer's lifeline and at abort().
  Reading read;
  read.remote = transport->fabric_.remoteAddress(remote);
  read.key = key;
  read.dst = dst;
  read.n = n;
  read.deadline = Clock::now() + transport->timeout_;
  checkRead(n, read.deadline, false);
  reading = read;
}

bool OfiTransport::Stream::continueRead() {
  try {
    return stepRead();
  } catch (const CommError&) {
    reading.reset(); // checkRead abandoned a posted piece already
    throw;
  }
}

bool OfiTransport::Stream::stepRead() {
  Reading& read = *reading;
  if (read.posted) {
    if (reader->state == 0) {
      checkRead(read.n, read.deadline, true);
      return false;
    }
    read.posted = false;
    if (reader->state < 0) {
      throw CommError(CommError::Kind::kPeer, "libfabric: reading " + std::to_string(read.piece) + " bytes from " +
                                                  rankName(peer) + " failed: " + reader->error);
    }
    std::memcpy(read.dst + read.done, reader->memory.get(), read.piece);
    read.done += read.piece;
  }
  if (read.done == read.n) {
    reading.reset();
    return true;
  }
  if (!postPiece()) {
    // rxm answers -FI_EAGAIN for as long as a killed peer's connection is not torn down.
    checkRead(read.n, read.deadline, false);
  }
  return false;
}

bool OfiTransport::Stream::postPiece() {
  Reading& read = *reading;
  const size_t n = std::min(kReadPieceBytes, read.n - read.done);
  ofi::Fabric& fabric = transport->fabric_;
  if (!reader || reader->capacity < n) {
    if (reader) {
      fabric.deregister(reader->region);
    }
    reader = std::make_unique<Read>();
    reader->stream = this;
    reader->post = ofi::Posted{{}, reader.get(), kRead, 0};
    reader->capacity = std::min(kReadPieceBytes, std::max(n, kChunkBytes));
    reader->memory.reset(new char[reader->capacity]);
    std::string why;
    if (fabric.registersLocal() &&
        !fabric.registerMemory(reader->memory.get(), reader->capacity, FI_READ, &reader->region, &why)) {
      reader.reset();
      throw CommError(CommError::Kind::kPeer, "cannot read " + std::to_string(n) + " bytes from " + rankName(peer) +
                                                  ": " + why);
    }
  }
  reader->state = 0;
  reader->error.clear();
  const ssize_t result = fi_read(ep(), reader->memory.get(), n, reader->region.desc, address, read.remote + read.done,
                                 read.key, &reader->post);
  if (result == -FI_EAGAIN) {
    return false;
  }
  if (result != 0) {
    throw CommError(CommError::Kind::kPeer, "libfabric: reading " + std::to_string(n) + " bytes from " +
                                                rankName(peer) + " failed: " + ofi::errorText(static_cast<int>(-result)));
  }
  read.piece = n;
  read.posted = true;
  return true;
}

void OfiTransport::Stream::abandonRead() {
  if (reading && reading->posted) {
    // Its completion may still come, and lands in memory of the stream's own.
    reader->abandoned = true;
    abandoned.push_back(std::move(reader));
  }
  reading.reset();
}

void OfiTransport::Stream::checkRead(size_t n, Deadline deadline, bool posted) {
  transport->checkLifelines(false);
  CommError::Kind kind = CommError::Kind::kPeer;
  std::string why;
  if (gone()) {
    why = endedWhy();
  } else if (!error.empty()) {
    why = error;
  } else if (transport->aborting_) {
    kind = CommError::Kind::kAborted;
    why = "the group was aborted while reading " + std::to_string(n) + " bytes from " + rankName(peer);
  } else if (Clock::now() >= deadline) {
    kind = CommError::Kind::kTimeout;
    why = "timed out reading " + std::to_string(n) + " bytes from " + rankName(peer) + " after " +
          std::to_string(transport->timeout_.count()) + " ms";
  } else {
    return;
  }
  if (posted) {
    reader->abandoned = true;
    abandoned.push_back(std::move(reader));
  }
  throw CommError(kind, why);
}

void OfiTransport::Stream::finishRead(Read* read, int state, const std::string& why) {
  if (!read->abandoned) {
    read->state = state;
    read->error = why;
    return;
  }
  transport->fabric_.deregister(read->region);
  for (auto it = abandoned.begin(); it != abandoned.end(); ++it) {
    if (it->get() == read) {
      abandoned.erase(it);
      return;
    }
  }
}

} // namespace torus
