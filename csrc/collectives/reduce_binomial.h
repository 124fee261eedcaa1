#pragma once

#include <cstddef>

#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// On return buf on root (count elements of reducer.elementSize) holds the reduction over all
// ranks; buf on the other ranks holds partial reductions. Staging comes from scratch, which must
// not overlap buf.
void reduce_binomial(Comm& comm, void* buf, size_t count, const Reducer& reducer, int root,
                     const Chunking& chunking, Scratch& scratch);

} // namespace torus
