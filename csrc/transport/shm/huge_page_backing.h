// HugePageBacking: puts the buffers that peers copy from and into through the kernel
// (process_vm_readv/writev) on 2 MiB pages. Every such copy pins each page of the peer's buffer
// it touches; on 4 KiB pages that pinning is a large part of a big single-copy collective's time
// (BENCHMARKS.md: two_shot of 64 MiB at 4 ranks took 35 ms on 4 KiB pages, 26-28 ms on 2 MiB).
//
// The kernel moves a buffer onto huge pages on request (madvise MADV_COLLAPSE, Linux >= 6.1, at
// about a memory copy's speed), whatever the system's transparent-huge-page policy short of
// "never". It is asked the second time a buffer of at least kMinBytes is posted at the same
// address and size, and never again for it: a buffer used again and again (DDP's buckets) pays
// one collapse, a buffer posted once pays none, and one freed and allocated anew at the same place
// pays at most one. Where the kernel cannot (older kernels, THP off, pinned pages), the buffer
// stays as it is: only speed depends on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>

namespace torus {

class HugePageBacking {
 public:
  static constexpr size_t kMinBytes = 4 << 20;
  // How many buffers it remembers (the oldest is forgotten first).
  static constexpr size_t kRemembered = 256;

  // Called before the range [address, address + nbytes) of this process is posted to peers.
  void prepare(uint64_t address, size_t nbytes);

 private:
  struct Buffer {
    uint64_t address;
    size_t nbytes;
    bool asked; // the collapse was asked for (posted twice)
  };
  std::mutex mutex_;
  std::deque<Buffer> buffers_;
};

} // namespace torus
