// Ring reduce-scatter of device memory staged through pinned host memory, for ranks that cannot
// map each other's device memory (other hosts), n ranks, S bytes.
//
// The ring of ring_reduce_scatter (ringPass), with the device in the loop: what travels is sent
// from a pinned mirror of the device buffer, and a received chunk lands in a pinned slot that the
// reduction kernel reads directly (no host-to-device copy, no CPU reducer) into the device buffer;
// the reduced chunk is then copied back to the mirror, from which the next step forwards it.
// Before the pass, this rank's first block is copied to the mirror.
//
// Steps: n-1. Bytes sent per rank: S(n-1)/n, the same received; device-host traffic per rank:
// S(n-1)/n + S_first down, the received S(n-1)/n read over the bus by the kernel. Pipelining:
// kChunksInFlight receives are posted ahead, so while the device reduces and copies chunk k the
// next chunks keep arriving.
#include "collectives/device/staged_ring_reduce_scatter.h"

#include <algorithm>

#include "collectives/ring_pass.h"

namespace torus {

void staged_ring_reduce_scatter(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf,
                                const Blocks& blocks, const Chunking& chunking) {
  const int n = comm.size();
  if (n == 1) {
    return;
  }
  const size_t elementSize = torus::elementSize(op.dtype);
  const size_t slotBytes = std::min(chunkElements(chunking, elementSize), largestCount(blocks)) * elementSize;
  char* mirror = path.staging(StagingUse::kMirror, spanOf(blocks) * elementSize, comm.deadline());
  char* slots = path.staging(StagingUse::kSlots, kChunksInFlight * slotBytes, comm.deadline());
  const auto slot = [slots, slotBytes](size_t index) { return slots + (index % kChunksInFlight) * slotBytes; };
  char* device = static_cast<char*>(buf);

  const int first = (comm.rank() + n - 1) % n;
  path.copy(mirror + blocks.offsets[first] * elementSize, device + blocks.offsets[first] * elementSize,
            blocks.counts[first] * elementSize);
  path.synchronize(comm.deadline(), {"staged_ring_reduce_scatter staging copy of the first block"});
  ringPass(
      comm, mirror, blocks, elementSize, chunking, comm.rank() - 1, kChunksInFlight,
      [&](size_t index, const Chunk&) -> void* { return slot(index); },
      [&](size_t index, const Chunk& chunk) {
        char* target = device + chunk.offset * elementSize;
        const void* sources[2] = {target, slot(index)};
        path.reduce(op, target, sources, 2, chunk.count);
        path.copy(mirror + chunk.offset * elementSize, target, chunk.count * elementSize);
        path.synchronize(comm.deadline(), {"staged_ring_reduce_scatter reduce of a chunk received", -1, first});
      });
}

} // namespace torus
