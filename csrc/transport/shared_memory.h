// SharedMemory: what ranks that map each other's memory offer collectives beyond messages —
// announcements ("postings") that peers read directly, one-shot slots, and single copies
// between the processes' own buffers, or plain loads and stores where a peer's buffer lies in
// memory this rank maps (SharedTensorArena). A Comm offers it (Comm::sharedMemory()) when its
// transport reaches every one of its ranks through shared memory; the ranks here are the Comm's,
// 0..n-1.
//
// A collective on shared memory, on every member in the same order: beginCollective(), post()
// this rank's posting and waitPosted() for every peer's, then slots or single copies, and, where
// a rank must know that its peers are done with its buffer, signalDelivered() to every peer and
// waitDeliveries(). Deadlines bound every wait; failures throw CommError as messages do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "transport/transport.h"

namespace torus {

class SharedMemory {
 public:
  // Each rank's one-shot slot (there are two, used by alternate collectives of the rank): the
  // most one_shot allreduce moves.
  static constexpr size_t kSlotBytes = 512 * 1024;

  // What a rank announces for one shm collective; peers check that their calls agree.
  struct Posting {
    uint64_t epoch = 0; // what beginCollective() returned to the poster: names its slot
    uint64_t address = 0; // in the poster's address space
    uint64_t nbytes = 0;
    uint64_t tag = 0; // the collective's sequence number, as its messages carry it
    CallSignature call;
    // Filled in by the transport, not by the caller of post(): the poster's shared tensor segment
    // that holds the buffer (segmentFd -1: none)...
    int64_t segmentFd = -1;
    uint64_t segmentBase = 0; // in the poster's address space
    uint64_t segmentBytes = 0;
    uint64_t segmentId = 0; // never reused by the poster, where its fd may be
    // The segments the poster's arena has given back to the system, ever: when it moves, the
    // receiver drops its mappings of the poster's segments that are gone.
    uint64_t releasedSegments = 0;
    // ...and, in what waitPosted() returns, the buffer mapped into this process when it lies in
    // such a segment; null otherwise (copy with readPeer/writePeer).
    char* mapped = nullptr;
  };

  virtual ~SharedMemory() = default;

  // True when every member can read and write every other member's memory (process_vm_readv/
  // writev): the condition for the single-copy algorithms. Every member sees the same value.
  virtual bool singleCopy() const = 0;

  // Begins one shm collective; call once per collective, on every member in the same order.
  // Returns this rank's epoch for it, which names its slot.
  virtual uint64_t beginCollective() = 0;
  // This rank's one-shot slot for `epoch` (kSlotBytes), to fill before post(): waits until every
  // peer that read it in an earlier collective has released it.
  virtual char* claimSlot(uint64_t epoch, Deadline deadline) = 0;
  // A member's slot as it posted it (its posting's epoch); this rank's own too.
  virtual const char* slot(int rank, uint64_t epoch) const = 0;
  // Tells `rank` that this rank has finished reading its slot of `epoch`.
  virtual void releaseSlot(int rank, uint64_t epoch) = 0;

  // Announces this rank's posting to every peer of the collective begun last.
  virtual void post(const Posting& posting) = 0;
  // Waits until `peer` has posted in the collective begun last and returns its posting; throws
  // CommError on timeout, abort, the peer's death, or when the peer sends messages of mine.tag
  // with a different call instead (it runs another algorithm or collective).
  virtual Posting waitPosted(int peer, const Posting& mine, Deadline deadline) = 0;

  // Copies between this process and a peer's memory (single copy through the kernel).
  virtual void readPeer(int peer, uint64_t address, void* dst, size_t nbytes) = 0;
  virtual void writePeer(int peer, uint64_t address, const void* src, size_t nbytes) = 0;
  // Runs use() on `peer`'s buffer through its Posting::mapped, counting nbytes of traffic with the
  // peer as readPeer/writePeer do. Throws CommError as they do once the peer gave up on the group;
  // the peer's abort waits for use() to return, so it reuses nothing use() touches.
  virtual void useMapped(int peer, size_t nbytes, const std::function<void()>& use) = 0;
  // Counts one delivery into `peer` (this rank is done with its buffer) and wakes it.
  virtual void signalDelivered(int peer) = 0;
  // Waits until every peer has counted one more delivery into this rank than before.
  virtual void waitDeliveries(Deadline deadline) = 0;
};

} // namespace torus
