// Ring reduce-scatter, n ranks, S bytes in buf, block b of S_b bytes (evenly: S/n).
//
// Steps: n-1. At step s rank r sends its partial sum of block (r-1-s) to rank r+1 and receives
// rank r-1's partial sum of block (r-2-s), which it reduces into its own copy; after step n-2 the
// block received was block r, now reduced over all n ranks.
// Bytes sent per rank: S - S_r, that is S(n-1)/n for even blocks; the same received and reduced.
// Messages: each step's block travels in chunks of at most chunkBytes. A chunk received at step s
// is reduced and at once sent on as part of step s+1, so receiving chunk k+1 overlaps reducing
// chunk k, and step s+1 starts as soon as step s's first chunk is in.
// Staging: kChunksInFlight chunk-sized slots of scratch, reused round-robin. Sends go straight
// from buf: a chunk is sent only once fully reduced, and never written again.
#include "collectives/ring_reduce_scatter.h"

#include <algorithm>

#include "collectives/ring_pass.h"

namespace torus {

void ring_reduce_scatter(Comm& comm, void* buf, const Blocks& blocks, const Reducer& reducer,
                         const Chunking& chunking, Scratch& scratch) {
  const size_t elementSize = reducer.elementSize;
  const size_t slotBytes = std::min(chunkElements(chunking, elementSize), largestCount(blocks)) * elementSize;
  char* staging = static_cast<char*>(scratch.get(kChunksInFlight * slotBytes));
  const auto slot = [staging, slotBytes](size_t index) {
    return staging + (index % kChunksInFlight) * slotBytes;
  };
  char* bytes = static_cast<char*>(buf);
  ringPass(
      comm, buf, blocks, elementSize, chunking, comm.rank() - 1, kChunksInFlight,
      [&](size_t index, const Chunk&) -> void* { return slot(index); },
      [&](size_t index, const Chunk& chunk) {
        reducer(bytes + chunk.offset * elementSize, slot(index), chunk.count);
      });
}

} // namespace torus
