// SharedTensorArena: memory for tensors that this host's peers can map and then read and write
// with their own loads and stores, instead of through the kernel (process_vm_readv/writev).
//
// The backend's allocate_tensor (c10d's tensor allocation hook, which FSDP2 uses for its
// communication buffers, and the bench for its own) takes tensors from here. Each allocation of
// at least kMinBytes is one segment: a memfd (never named in /dev/shm) mapped here and held open
// for the life of the process, so that a peer of any group can open it through
// /proc/<pid>/fd/<fd> as the shm transport opens its segments. A freed segment is kept for a later
// allocation that fits it without wasting more than a quarter, and is never returned to the
// system while the process lives: a peer's mapping of it stays valid, and a peer that cached the
// mapping never sees another segment under the same fd. Torch's CUDA caching allocator keeps
// freed blocks in the same way.
//
// Segments of 2 MiB or more ask for huge pages (MADV_HUGEPAGE), which shared memory gets where
// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows (advise or wider; many systems ship
// "never"): with 8 ranks on 2 cores they made a 64 MiB allreduce 5-25% faster (BENCHMARKS.md).
//
// The shm transport posts the segment holding a buffer beside the buffer's address; a peer that
// maps it copies and reduces with plain loads and stores. Measured at 4 and 8 ranks on 2 cores,
// a 16-256 MiB allreduce ran 1.6-1.9x faster than between tensors of torch's (BENCHMARKS.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace torus {

class SharedTensorArena {
 public:
  // Smaller allocations get ordinary memory: their collectives go through the one-shot slots,
  // and a segment costs a file descriptor and a mapping in every peer.
  static constexpr size_t kMinBytes = 64 * 1024;
  // What memfd_create names every segment; a peer checks it before it maps one.
  static constexpr const char* kName = "torus-tensors";

  struct Segment {
    int fd = -1;
    uint64_t base = 0; // where it is mapped in this process
    size_t bytes = 0;
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
  // What is wrong with a peer's posting that puts its buffer [address, address + nbytes) in its
  // segment of segmentBytes at segmentBase; empty when nothing is.
  static std::string claimProblem(uint64_t address, uint64_t nbytes, uint64_t segmentBase, uint64_t segmentBytes);
  // What is wrong with the file behind the fd the peer named (`target`: its /proc link; fileBytes:
  // its size) as a segment of segmentBytes; empty when nothing is.
  static std::string fileProblem(const std::string& target, uint64_t fileBytes, uint64_t segmentBytes);

 private:
  SharedTensorArena() = default;
  std::optional<Segment> create(size_t bytes);

  mutable std::mutex mutex_;
  std::map<uint64_t, Segment> live_; // by base
  std::multimap<size_t, Segment> free_; // by size
};

} // namespace torus
