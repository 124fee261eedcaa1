#pragma once

#include <cstddef>

#include "collectives/blocks.h"
#include "comm/comm.h"

namespace torus {

// As ring_allgather: block comm.rank() of buf is this rank's contribution; on return every block
// of buf holds its owner's. Blocks are in elements of elementSize and may be uneven or empty, as
// long as every rank passes the same ones.
void direct_allgather(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize,
                      const Chunking& chunking);

} // namespace torus
