#include "transport/shm/ring_link.h"

#include <algorithm>
#include <cstring>

namespace torus {

namespace {

constexpr size_t kRingBytes = ShmTransport::kRingBytes;

// Copies n bytes into a ring at position pos (which may wrap), or out of it.
void copyIn(char* ring, uint64_t pos, const char* src, size_t n) {
  size_t at = pos % kRingBytes;
  size_t first = std::min(n, kRingBytes - at);
  std::memcpy(ring + at, src, first);
  std::memcpy(ring, src + first, n - first);
}

void copyOut(char* dst, const char* ring, uint64_t pos, size_t n) {
  size_t at = pos % kRingBytes;
  size_t first = std::min(n, kRingBytes - at);
  std::memcpy(dst, ring + at, first);
  std::memcpy(dst + first, ring, n - first);
}

} // namespace

size_t ShmTransport::RingLink::write(const iovec* parts, int count) {
  size_t wanted = 0;
  for (int i = 0; i < count; ++i) {
    wanted += parts[i].iov_len;
  }
  uint64_t free = freeBytes(out_->tail.load(std::memory_order_acquire));
  if (free < wanted) {
    // Ask the consumer to ring us when it frees space, then look again in case it just did.
    out_->producerWaiting.store(1, std::memory_order_seq_cst);
    free = freeBytes(out_->tail.load(std::memory_order_seq_cst));
  }
  size_t took = 0;
  for (int i = 0; i < count && free > 0; ++i) {
    const size_t n = std::min<size_t>(free, parts[i].iov_len);
    copyIn(out_->data, sendPos_, static_cast<const char*>(parts[i].iov_base), n);
    sendPos_ += n;
    free -= n;
    took += n;
  }
  return took;
}

ssize_t ShmTransport::RingLink::read(char* dst, size_t n) {
  const uint64_t head = in_->head.load(std::memory_order_acquire);
  const uint64_t available = head - recvPos_;
  // The peer writes the head in this rank's segment: a head behind what was read, or ahead by
  // more than the ring holds, would copy from past the ring.
  if (head < recvPos_ || available > kRingBytes) {
    brokeRing("head", head, "read", recvPos_);
  }
  const size_t got = std::min<uint64_t>(n, available);
  copyOut(dst, in_->data, recvPos_, got);
  recvPos_ += got;
  return static_cast<ssize_t>(got);
}

void ShmTransport::RingLink::flush() {
  out_->head.store(sendPos_, std::memory_order_release);
  shm::ringDoorbell(peerControl_);
}

void ShmTransport::RingLink::consumed() {
  in_->tail.store(recvPos_, std::memory_order_seq_cst);
  if (in_->producerWaiting.exchange(0, std::memory_order_seq_cst) != 0) {
    shm::ringDoorbell(peerControl_);
  }
}

uint64_t ShmTransport::RingLink::freeBytes(uint64_t tail) const {
  if (tail > sendPos_ || sendPos_ - tail > kRingBytes) {
    brokeRing("tail", tail, "written", sendPos_);
  }
  return kRingBytes - (sendPos_ - tail);
}

void ShmTransport::RingLink::brokeRing(const char* field, uint64_t theirs, const char* done, uint64_t ours) const {
  throw CommError(CommError::Kind::kPeer, rankName(peerRank_) + " broke the wire protocol: its ring's " + field +
                                              " is at byte " + std::to_string(theirs) + " where " +
                                              std::to_string(ours) + " were " + done + " and the ring holds " +
                                              std::to_string(kRingBytes));
}

} // namespace torus
