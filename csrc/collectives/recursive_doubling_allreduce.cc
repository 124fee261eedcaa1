// Recursive-doubling allreduce, n ranks, S bytes, p the largest power of two <= n.
//
// Steps: log2 p, plus 2 when n is not a power of two (the fold, see power_of_two_fold.h). In round
// k every rank exchanges its whole buffer with rank ^ 2^k and reduces the partner's copy into its
// own; after round k it holds the reduction over its group of 2^(k+1) ranks. Both partners
// combine the same two operands, and every op is commutative, so all ranks end bit-identical.
// Bytes sent per rank: S log2 p (plus S on a folded pair), the same received and reduced. Few
// steps, many bytes: the algorithm for small messages, where latency dominates.
// Messages: each round travels in chunks of at most chunkBytes, pipelined with the reduction of
// the chunks already in (see partner_exchange.h). Staging: kChunksInFlight chunk-sized slots.
#include "collectives/recursive_doubling_allreduce.h"

#include "collectives/partner_exchange.h"
#include "collectives/power_of_two_fold.h"

namespace torus {

void recursive_doubling_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                                  const Chunking& chunking, Scratch& scratch) {
  const ElementRange whole{0, count};
  allreduceFolded(comm, buf, count, reducer, chunking, scratch, [&](Comm& powerOfTwo) {
    for (int distance = 1; distance < powerOfTwo.size(); distance *= 2) {
      exchangeReduce(powerOfTwo, powerOfTwo.rank() ^ distance, buf, whole, whole, reducer,
                     chunking, scratch);
    }
  });
}

} // namespace torus
