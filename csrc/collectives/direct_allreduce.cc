// Direct allreduce (oneCCL's "direct", star-like), n ranks, S bytes: direct reduce-scatter then
// direct allgather over evenBlocks, so rank r ends the first step owning the full reduction of
// block r and hands it to every rank in the second.
//
// Steps: 2. Bytes sent per rank: 2S(n-1)/n, as the ring, but every rank talks to all n-1 others
// at once: the fewest steps for a bandwidth-optimal allreduce, for few ranks. Both steps are
// chunked and pipelined (see their files).
#include "collectives/direct_allreduce.h"

#include "collectives/blocks.h"
#include "collectives/direct_allgather.h"
#include "collectives/direct_reduce_scatter.h"

namespace torus {

void direct_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                      const Chunking& chunking, Scratch& scratch) {
  const Blocks blocks = evenBlocks(count, comm.size());
  direct_reduce_scatter(comm, buf, blocks, reducer, chunking, scratch);
  direct_allgather(comm, buf, blocks, reducer.elementSize, chunking);
}

} // namespace torus
