// Ring allgather of device memory staged through pinned host memory, for ranks that cannot map
// each other's device memory (other hosts), n ranks, S bytes in all.
//
// This rank's block is copied to a pinned mirror of the buffer, and ring_allgather's pass runs on
// the mirror: chunks land in place and are forwarded from there, and each is queued for its copy
// up into the device buffer the moment it lands, so the copies up overlap the transfers.
//
// Steps: n-1. Bytes sent per rank: S(n-1)/n, the same received; device-host traffic per rank:
// its block down, S(n-1)/n up.
#include "collectives/device/staged_ring_allgather.h"

#include <limits>

#include "collectives/ring_pass.h"

namespace torus {

void staged_ring_allgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize,
                           const Chunking& chunking, bool mirrored) {
  if (comm.size() == 1) {
    return;
  }
  char* mirror = path.staging(StagingUse::kMirror, spanOf(blocks) * elementSize, comm.deadline());
  char* device = static_cast<char*>(buf);
  if (!mirrored) {
    const size_t mine = blocks.offsets[comm.rank()] * elementSize;
    path.copy(mirror + mine, device + mine, blocks.counts[comm.rank()] * elementSize);
    path.synchronize(comm.deadline(), {"staged_ring_allgather staging copy of this rank's block"});
  }
  // Chunks are final on arrival, so every receive can be posted at once (as ring_allgather does).
  ringPass(
      comm, mirror, blocks, elementSize, chunking, comm.rank(), std::numeric_limits<size_t>::max(),
      [&](size_t, const Chunk& chunk) -> void* { return mirror + chunk.offset * elementSize; },
      [&](size_t, const Chunk& chunk) {
        path.copy(device + chunk.offset * elementSize, mirror + chunk.offset * elementSize,
                  chunk.count * elementSize);
      });
  // The mirror is reused by the next call.
  path.synchronize(comm.deadline(), {"staged_ring_allgather copies of the received blocks"});
}

} // namespace torus
