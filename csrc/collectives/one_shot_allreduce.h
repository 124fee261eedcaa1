#pragma once

#include <cstddef>

#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// In place, for a Comm whose ranks share memory (comm.sharedMemory() != nullptr) and buffers of
// at most SharedMemory::kSlotBytes. chunking and scratch are unused (the AllreduceFn signature).
void one_shot_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                        const Chunking& chunking, Scratch& scratch);

} // namespace torus
