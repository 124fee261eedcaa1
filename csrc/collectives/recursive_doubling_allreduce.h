#pragma once

#include <cstddef>

#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// In place: on return buf (count elements of reducer.elementSize) holds the reduction over all
// ranks, bit for bit the same on every rank. Staging comes from scratch, which must not overlap
// buf.
void recursive_doubling_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                                  const Chunking& chunking, Scratch& scratch);

} // namespace torus
