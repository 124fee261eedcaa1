#pragma once

#include "collectives/blocks.h"
#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// As ring_reduce_scatter: on return block comm.rank() of buf holds the reduction over all ranks
// of that block; the other blocks of buf are left as they were. Blocks are in elements of
// reducer.elementSize and may be uneven or empty, as long as every rank passes the same ones.
// Staging comes from scratch, which must not overlap buf.
void direct_reduce_scatter(Comm& comm, void* buf, const Blocks& blocks, const Reducer& reducer,
                           const Chunking& chunking, Scratch& scratch);

} // namespace torus
