#pragma once

#include <cstddef>

#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// In place, for a Comm whose ranks share memory and can copy between each other's buffers
// (comm.sharedMemory()->singleCopy()). Staging: one chunk of scratch.
void two_shot_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                        const Chunking& chunking, Scratch& scratch);

} // namespace torus
