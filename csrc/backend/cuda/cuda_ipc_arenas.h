// Arena memory by CUDA IPC, shared among a host's ranks by SharedArenas: each rank cudaMallocs
// one arena (IPC handles name whole allocations, not the caching allocator's sub-blocks) and
// opens its host peers' with cudaIpcOpenMemHandle (peer access enabled lazily). Ranks sharing
// one GPU work too: they are different processes, and IPC is refused only within one process.
#pragma once

#include <memory>

#include "backend/device_arenas.h"

namespace torus {

std::unique_ptr<ArenaMemory> makeCudaIpcMemory(int device);

} // namespace torus
