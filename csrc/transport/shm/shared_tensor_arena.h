// SharedTensorArena: memory for tensors that this host's peers can map and then read and write
// with their own loads and stores, instead of through the kernel (process_vm_readv/writev).
//
// The backend's allocate_tensor (c10d's tensor allocation hook, which FSDP2 uses for its
// communication buffers, and the bench for its own) takes tensors from here. Each allocation of
// at least kMinBytes is one segment: a memfd (never named in /dev/shm) mapped here and held open
// while it lives, so that a peer of any group can open it through /proc/<pid>/fd/<fd> as the shm
// transport opens its segments.
//
// A freed segment is kept for a later allocation that fits it without wasting more than a
// quarter, as torch's CUDA caching allocator keeps freed blocks, but only up to a limit
// (TORUS_SHARED_TENSOR_CACHE): by default as many bytes as the process's shared tensors held at
// once at their peak, so a workload that repeats (FSDP2's buffers, step after step) reuses every
// segment while the arena never holds more than twice its working set. Past the limit the
// segments freed longest ago go back to the system (munmap and close); emptyCache() gives back
// every free one, as does destroying the last group. Each segment carries an id that is never
// reused, and the arena counts the segments it gave back: a peer that cached its mapping of a
// segment by fd tells a later segment under the same fd by its id, and drops the mappings of
// given-back segments when the count it is posted moves (shm_transport.cc).
//
// After fork the child's arena starts empty, as a fresh process's: the parent's free segments are
// unmapped and closed in the child, and its live ones (tensors the child inherited) are mapped
// again privately, copy-on-write as torch's own memory is after fork, so a child's write never
// reaches the parent; freeing such a tensor in the child unmaps it there.
//
// Segments of 2 MiB or more ask for huge pages (MADV_HUGEPAGE), which shared memory gets where
// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows (advise or wider; many systems ship
// "never"): with 8 ranks on 2 cores they made a 64 MiB allreduce 5-25% faster (BENCHMARKS.md).
//
// The shm transport posts the segment holding a buffer beside the buffer's address; a peer that
// maps it copies and reduces with plain loads and stores. Measured at 4 and 8 ranks on 2 cores,
// a 16-256 MiB allreduce ran 1.6-1.9x faster than between tensors of torch's (BENCHMARKS.md).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torus {

class SharedTensorArena {
 public:
  // Smaller allocations get ordinary memory: their collectives go through the one-shot slots,
  // and a segment costs a file descriptor and a mapping in every peer.
  static constexpr size_t kMinBytes = 64 * 1024;
  // What memfd_create names every segment; a peer checks it before it maps one.
  static constexpr const char* kName = "torus-tensors";
  // setCacheLimit's "as many bytes as were live at the peak".
  static constexpr int64_t kAutoLimit = -1;

  struct Segment {
    int fd = -1;
    uint64_t base = 0; // where it is mapped in this process
    size_t bytes = 0;
    uint64_t id = 0; // this process's, never reused
    uint64_t freedAt = 0; // when it was freed last, in frees counted; orders the free ones
  };

  struct Stats {
    uint64_t liveBytes = 0;
    uint64_t liveSegments = 0;
    uint64_t freeBytes = 0; // kept for reuse
    uint64_t freeSegments = 0;
    uint64_t limitBytes = 0; // the most freeBytes may reach now
    uint64_t peakLiveBytes = 0; // since the arena last gave back everything
    uint64_t releasedSegments = 0; // given back to the system, ever
  };

  // The process's arena; it lives until the process exits.
  static SharedTensorArena& instance();

  // nbytes of memory peers can map, page-aligned; nullptr when nbytes < kMinBytes or the system
  // refuses a segment (the caller then allocates ordinary memory).
  void* allocate(size_t nbytes);
  // Takes back what allocate returned.
  void release(void* data);
  // The live segment that holds [address, address + nbytes) of this process, if any.
  std::optional<Segment> segmentHolding(uint64_t address, size_t nbytes) const;
  // Segments given back to the system, ever: a peer that sees it move drops its mappings of them.
  uint64_t releasedSegments() const {
    return released_.load(std::memory_order_acquire);
  }

  // A group that may allocate from the arena begins, with its TORUS_SHARED_TENSOR_CACHE: the most
  // bytes of free segments kept (kAutoLimit: the peak of live bytes). The process has one arena:
  // the latest of the groups alive sets the limit. When the last group ends, every free segment
  // goes back to the system, and later frees go back at once.
  void attachGroup(const void* group, int64_t cacheLimit);
  void detachGroup(const void* group);
  // Gives every free segment back to the system (torch_torus.empty_cache()); returns their bytes.
  uint64_t emptyCache();
  Stats stats() const;

  // What is wrong with a peer's posting that puts its buffer [address, address + nbytes) in its
  // segment of segmentBytes at segmentBase; empty when nothing is.
  static std::string claimProblem(uint64_t address, uint64_t nbytes, uint64_t segmentBase, uint64_t segmentBytes);
  // What is wrong with the file behind the fd the peer named (`target`: its /proc link; fileBytes:
  // its size) as a segment of segmentBytes; empty when nothing is.
  static std::string fileProblem(const std::string& target, uint64_t fileBytes, uint64_t segmentBytes);

 private:
  SharedTensorArena() = default;
  std::optional<Segment> create(size_t bytes);
  // Gives free segments back, those freed longest ago first, until at most `keep` bytes are free.
  // Holds mutex_.
  void trimTo(uint64_t keep);
  uint64_t limitLocked() const;
  // pthread_atfork's handlers: the arena's lock is held across fork; the child's arena forgets the
  // parent's segments (the class comment).
  void beforeFork();
  void afterForkInParent();
  void afterForkInChild();

  mutable std::mutex mutex_;
  std::map<uint64_t, Segment> live_; // by base
  std::multimap<size_t, Segment> free_; // by size
  // Tensors a forked child inherited from its parent's segments, mapped privately here: by base.
  std::map<uint64_t, size_t> inherited_;
  uint64_t liveBytes_ = 0;
  uint64_t freeBytes_ = 0;
  uint64_t peakLiveBytes_ = 0;
  // The groups alive, oldest first, with their limits.
  std::vector<std::pair<const void*, int64_t>> groups_;
  uint64_t nextId_ = 1;
  uint64_t frees_ = 0;
  std::atomic<uint64_t> released_{0};
};

} // namespace torus
