#pragma once

#include "collectives/blocks.h"
#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

// On device memory: every rank's block comm.rank() of buf (blocks in elements of elementSize
// bytes) ends in every rank's buf. Needs comm.deviceArenas().
void arena_allgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize);

} // namespace torus
