// Rabenseifner's allreduce, n ranks, S bytes, p the largest power of two <= n: recursive-halving
// reduce-scatter, then recursive-doubling allgather, over p even blocks of buf.
//
// Steps: 2 log2 p, plus 2 when n is not a power of two (the fold, see power_of_two_fold.h).
// Reduce-scatter: a rank starts with all p blocks; in the round at distance d = p/2, p/4, ..., 1
// it keeps the half of its blocks on its side of bit d, sends the other half to rank ^ d and
// reduces that rank's copy of the kept half into its own, ending with block `rank` reduced over
// all p ranks. Allgather: the same rounds backwards, d = 1, 2, ..., p/2, each rank sending what it
// holds to rank ^ d and receiving as much, in place.
// Bytes sent per rank: 2S(p-1)/p (plus S on a folded pair); half of what arrives is reduced.
// Counts below p leave some blocks empty; an empty half is simply not sent, and every rank knows
// which, so any count works (oneCCL refuses count < p).
// Messages: every exchange travels in chunks of at most chunkBytes, pipelined with the reduction
// of the chunks already in (see partner_exchange.h). Staging: kChunksInFlight chunk-sized slots.
#include "collectives/rabenseifner_allreduce.h"

#include <algorithm>

#include "collectives/blocks.h"
#include "collectives/partner_exchange.h"
#include "collectives/power_of_two_fold.h"

namespace torus {

void rabenseifner_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                            const Chunking& chunking, Scratch& scratch) {
  allreduceFolded(comm, buf, count, reducer, chunking, scratch, [&](Comm& powerOfTwo) {
    const int p = powerOfTwo.size();
    const int rank = powerOfTwo.rank();
    const Blocks blocks = evenBlocks(count, p);
    // Blocks [first, first + number) are consecutive in buf.
    const auto span = [&](int first, int number) {
      const int last = first + number - 1;
      return ElementRange{blocks.offsets[first],
                          blocks.offsets[last] + blocks.counts[last] - blocks.offsets[first]};
    };
    // This rank holds blocks [first, first + 2d) entering the halving round at distance d, and
    // [first, first + d) entering the doubling round at distance d.
    int first = 0;
    for (int distance = p / 2; distance >= 1; distance /= 2) {
      const bool keepLower = (rank & distance) == 0;
      const int kept = keepLower ? first : first + distance;
      const int given = keepLower ? first + distance : first;
      exchangeReduce(powerOfTwo, rank ^ distance, buf, span(given, distance),
                     span(kept, distance), reducer, chunking, scratch);
      first = kept;
    }
    for (int distance = 1; distance < p; distance *= 2) {
      const int partnerFirst = first ^ distance;
      exchangeCopy(powerOfTwo, rank ^ distance, buf, span(first, distance),
                   span(partnerFirst, distance), reducer.elementSize, chunking);
      first = std::min(first, partnerFirst);
    }
  });
}

} // namespace torus
