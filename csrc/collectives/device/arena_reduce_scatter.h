#pragma once

#include "collectives/blocks.h"
#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

// In place on device memory: block comm.rank() of buf (blocks in elements of op's dtype) ends
// holding its reduction over all ranks; the other blocks keep unspecified values. Needs
// comm.deviceArenas().
void arena_reduce_scatter(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, const Blocks& blocks);

} // namespace torus
