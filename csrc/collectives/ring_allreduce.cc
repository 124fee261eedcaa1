// Ring allreduce, n ranks, S bytes: ring reduce-scatter then ring allgather over evenBlocks, so
// rank r ends the first phase owning the full reduction of block r and the second hands it round.
//
// Steps: 2(n-1). Bytes sent per rank: 2 S(n-1)/n (bandwidth-optimal); the same received, of which
// S(n-1)/n is reduced. Both phases are chunked and pipelined (see their files).
#include "collectives/ring_allreduce.h"

#include "collectives/blocks.h"
#include "collectives/ring_allgather.h"
#include "collectives/ring_reduce_scatter.h"

namespace torus {

void ring_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                    const Chunking& chunking, Scratch& scratch) {
  if (comm.size() == 1) {
    return;
  }
  const Blocks blocks = evenBlocks(count, comm.size());
  ring_reduce_scatter(comm, buf, blocks, reducer, chunking, scratch);
  ring_allgather(comm, buf, blocks, reducer.elementSize, chunking);
}

} // namespace torus
