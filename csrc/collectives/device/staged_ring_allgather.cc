// Ring allgather of device memory staged through pinned host memory, for ranks that cannot map
// each other's device memory (other hosts), n ranks, S bytes in all.
//
// This rank's block is copied to a pinned mirror of the buffer, ring_allgather runs on the
// mirror (chunks land in place and are forwarded from there, pipelined), and the other ranks'
// blocks are copied up into the device buffer.
//
// Steps: n-1. Bytes sent per rank: S(n-1)/n, the same received; device-host traffic per rank:
// its block down, S(n-1)/n up.
#include "collectives/device/staged_ring_allgather.h"

#include <algorithm>

#include "collectives/ring_allgather.h"

namespace torus {

void staged_ring_allgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize,
                           const Chunking& chunking, bool mirrored) {
  const int n = comm.size();
  if (n == 1) {
    return;
  }
  size_t span = 0;
  for (int b = 0; b < n; ++b) {
    span = std::max(span, blocks.offsets[b] + blocks.counts[b]);
  }
  char* mirror = path.staging(StagingUse::kMirror, span * elementSize);
  char* device = static_cast<char*>(buf);
  const auto copyBlock = [&](int b, char* to, const char* from) {
    path.copy(to + blocks.offsets[b] * elementSize, from + blocks.offsets[b] * elementSize,
              blocks.counts[b] * elementSize);
  };
  if (!mirrored) {
    copyBlock(comm.rank(), mirror, device);
    path.synchronize(comm.deadline());
  }
  ring_allgather(comm, mirror, blocks, elementSize, chunking);
  for (int b = 0; b < n; ++b) {
    if (b != comm.rank()) {
      copyBlock(b, device, mirror);
    }
  }
  // The mirror is reused by the next call.
  path.synchronize(comm.deadline());
}

} // namespace torus
