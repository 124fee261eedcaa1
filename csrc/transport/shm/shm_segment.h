// The layout of a ShmTransport segment (shm_transport.h) and the wake-ups through it: what
// shm_transport.cc, ring_link.cc and peer_memory.cc share. Private to csrc/transport/shm/.
#pragma once

#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>

#include "transport/departure.h"
#include "transport/shm/shm_transport.h"

namespace torus {
namespace shm {

constexpr uint64_t kSegmentMagic = 0x746f7275732d7368; // "torus-sh"
constexpr size_t kLine = 64;

// One posting cell: what the segment's owner announced to one peer for their collective `epoch`.
struct alignas(kLine) SharedPosting {
  std::atomic<uint64_t> epoch; // counted per pair of ranks
  uint64_t ownEpoch; // the owner's own count: names its slot
  uint64_t address;
  uint64_t nbytes;
  uint64_t tag;
  CallSignature call;
  int64_t segmentFd; // the owner's SharedTensorArena segment holding the buffer; -1: none
  uint64_t segmentBase;
  uint64_t segmentBytes;
  uint64_t segmentId;
  uint64_t releasedSegments;
};

// cpu_set_t's size in 64-bit words.
constexpr size_t kCoreWords = sizeof(cpu_set_t) / sizeof(uint64_t);

struct ControlBlock {
  uint64_t magic;
  int32_t pid;
  // The cores the owner may run on now (its affinity mask, re-read every SpinWait::kCoresPeriod
  // while it waits), as cpu_set_t's words.
  std::atomic<uint64_t> cores[kCoreWords];
  // The core the owner ran on when its latest wait began (TORUS_WAIT=auto); -1: not known.
  std::atomic<int32_t> core;
  // Set when the owner destroys its transport: its exit afterwards is a departure, not a death.
  std::atomic<uint32_t> left; // 0: here; else 1 + its Departure (departureOf)
  // Set when the owner gives up on the group (abort()); faultText says why.
  std::atomic<uint32_t> faulted;
  char faultText[kFaultTextBytes];
  alignas(kLine) std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleepers;
  // Peers that finished reading each one-shot slot, ever.
  alignas(kLine) std::atomic<uint64_t> slotReleases[2];
  // Peers reading or writing the owner's memory right now (guardedPeerAccess).
  alignas(kLine) std::atomic<uint32_t> crossCopiers;
};

// Deliveries into the segment's owner from one peer, ever.
struct alignas(kLine) DeliveryCount {
  std::atomic<uint64_t> count;
};

// Written by one peer (the producer), read by the segment's owner.
struct SharedRing {
  alignas(kLine) std::atomic<uint64_t> head; // bytes written, ever
  alignas(kLine) std::atomic<uint64_t> tail; // bytes consumed, ever
  alignas(kLine) std::atomic<uint32_t> producerWaiting;
  alignas(kLine) char data[ShmTransport::kRingBytes];
};

constexpr size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}
// A segment of a group of `size` ranks: the control block; two posting cells per rank (the
// owner's announcements to that peer, for alternate collectives of the pair); the deliveries from
// each rank; the two one-shot slots; one inbound ring per rank.
constexpr size_t kPostingsOffset = roundUp(sizeof(ControlBlock), kLine);

inline size_t deliveriesOffset(int size) {
  return kPostingsOffset + 2 * static_cast<size_t>(size) * sizeof(SharedPosting);
}

inline size_t slotsOffset(int size) {
  return roundUp(deliveriesOffset(size) + static_cast<size_t>(size) * sizeof(DeliveryCount), 4096);
}

inline size_t ringsOffset(int size) {
  return slotsOffset(size) + 2 * ShmTransport::kSlotBytes;
}

inline size_t segmentBytes(int size) {
  return ringsOffset(size) + static_cast<size_t>(size) * sizeof(SharedRing);
}

inline void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Tells the owner of `control` that something it may wait for changed, waking it if it sleeps.
inline void ringDoorbell(ControlBlock* control) {
  control->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (control->sleepers.load(std::memory_order_seq_cst) > 0) {
    futexWake(&control->doorbell);
  }
}

// "rank R gave up on the group: <why>", from the control block of rank R, which gave up.
inline std::string gaveUpText(const ControlBlock* control, int rank) {
  return "rank " + std::to_string(rank) + " gave up on the group: " +
         std::string(control->faultText, ::strnlen(control->faultText, kFaultTextBytes));
}

} // namespace shm

// A mapping of one rank's segment (this rank's own, or a peer's).
struct ShmTransport::Segment {
  char* base = nullptr;
  size_t bytes = 0;
  int groupSize = 0;

  ~Segment() {
    if (base != nullptr) {
      ::munmap(base, bytes);
    }
  }
  shm::ControlBlock* control() const {
    return reinterpret_cast<shm::ControlBlock*>(base);
  }
  // The cell the owner posts to `reader` in for their collective `pairEpoch`.
  shm::SharedPosting* posting(int reader, uint64_t pairEpoch) const {
    return reinterpret_cast<shm::SharedPosting*>(base + shm::kPostingsOffset) + 2 * reader + (pairEpoch & 1);
  }
  shm::DeliveryCount* deliveries(int from) const {
    return reinterpret_cast<shm::DeliveryCount*>(base + shm::deliveriesOffset(groupSize)) + from;
  }
  char* slot(uint64_t ownEpoch) const {
    return base + shm::slotsOffset(groupSize) + (ownEpoch & 1) * kSlotBytes;
  }
  // The ring that rank `producer` writes into this segment.
  shm::SharedRing* ring(int producer) const {
    return reinterpret_cast<shm::SharedRing*>(base + shm::ringsOffset(groupSize)) + producer;
  }
};

// How a peer left, from its segment's `left` (written by the peer: a value of no Departure reads
// as a destroyed group).
inline Departure departureOf(uint32_t left) {
  return left == 1 + static_cast<uint32_t>(Departure::kProcessEnded) ? Departure::kProcessEnded
                                                                      : Departure::kGroupDestroyed;
}

} // namespace torus
