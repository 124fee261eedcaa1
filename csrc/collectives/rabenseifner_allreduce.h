#pragma once

#include <cstddef>

#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// In place: on return buf (count elements of reducer.elementSize) holds the reduction over all
// ranks. Any count, including fewer elements than ranks. Staging comes from scratch, which must
// not overlap buf.
void rabenseifner_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                            const Chunking& chunking, Scratch& scratch);

} // namespace torus
