#pragma once

#include "collectives/blocks.h"
#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

// In place on device memory: block comm.rank() of buf (blocks in elements of op's dtype) ends
// holding its reduction over all ranks, and so does the same range of the path's kMirror staging,
// which staged_ring_allgather can send from. Other blocks keep unspecified values.
void staged_ring_reduce_scatter(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf,
                                const Blocks& blocks, const Chunking& chunking);

} // namespace torus
