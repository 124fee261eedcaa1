#pragma once

#include "collectives/blocks.h"
#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

// On device memory: every rank's block comm.rank() of buf (blocks in elements of elementSize
// bytes) ends in every rank's buf. `mirrored`: the path's kMirror staging already holds this
// rank's block (as staged_ring_reduce_scatter leaves it), so it is not copied down again.
void staged_ring_allgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize,
                           const Chunking& chunking, bool mirrored);

} // namespace torus
