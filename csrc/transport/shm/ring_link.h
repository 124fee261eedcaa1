// ShmTransport::RingLink: the message layer's Link to one peer over shared memory: this rank's
// ring in the peer's segment out, the peer's ring in this rank's segment in (byte streams, each
// written by one side and read by the other), and the peer's memory read by a SingleCopyRead.
#pragma once

#include <cstdint>

#include "transport/link.h"
#include "transport/shm/peer_memory.h"
#include "transport/shm/shm_segment.h"

namespace torus {

class ShmTransport::RingLink : public Link {
 public:
  RingLink(shm::SharedRing* out, shm::SharedRing* in, shm::ControlBlock* peerControl, int pid, int peerRank,
           bool peerReads)
      : out_(out), in_(in), peerControl_(peerControl), peerRank_(peerRank), peerReads_(peerReads),
        reading_(peerControl, pid, peerRank) {}

  size_t write(const iovec* parts, int count) override;
  ssize_t read(char* dst, size_t n) override;
  void flush() override;
  void consumed() override;

  size_t peerReadsAbove() const override {
    return peerReads_ ? kSingleCopyBytes : SIZE_MAX;
  }
  // Copies nothing: ShmTransport::workOutsideLock copies the pieces, which continueRead waits
  // for without blocking.
  void startRead(uint64_t address, uint64_t key, char* dst, size_t n) override {
    reading_.start(address, dst, n);
  }
  bool continueRead() override {
    return reading_.finished();
  }
  void abandonRead() override {
    reading_.abandon();
  }
  // The read under way, for the thread that copies its pieces.
  shm::SingleCopyRead& reading() {
    return reading_;
  }

 private:
  // Room in the ring out, given the consumer's tail, which the peer writes in its segment: a tail
  // ahead of what was written, or behind it by more than the ring holds, would copy past the ring.
  uint64_t freeBytes(uint64_t tail) const;
  // The peer set its ring's `field` to `theirs`, which no write of its could have, `ours` bytes
  // having been `done` here: fails the peer.
  [[noreturn]] void brokeRing(const char* field, uint64_t theirs, const char* done, uint64_t ours) const;

  shm::SharedRing* out_;
  shm::SharedRing* in_;
  shm::ControlBlock* peerControl_;
  int peerRank_;
  bool peerReads_;
  uint64_t sendPos_ = 0;
  uint64_t recvPos_ = 0;
  shm::SingleCopyRead reading_;
};

} // namespace torus
