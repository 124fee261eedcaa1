// One round of recursive doubling or halving: a chunked exchange with a single partner rank, the
// part that recursive_doubling_allreduce, rabenseifner_allreduce and their fold share.
#pragma once

#include <cstddef>

#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// Elements [offset, offset + count) of a buffer.
struct ElementRange {
  size_t offset = 0;
  size_t count = 0;
};

// Sends `sent` of buf to peer while receiving peer's copy of `received` and reducing it into
// buf's, chunk by chunk (see chunkElements). The peer makes the mirror call: its `sent` is this
// rank's `received` and the other way round; either may be empty, which makes the exchange
// one-way. `sent` and `received` must be the same range or disjoint. Chunk k + kChunksInFlight
// is posted, both ways, once chunk k has completed both ways, so a two-way exchange runs at the
// pace of its slower side and staging is kChunksInFlight chunk-sized slots of scratch, which must
// not overlap buf.
void exchangeReduce(Comm& comm, int peer, void* buf, const ElementRange& sent,
                    const ElementRange& received, const Reducer& reducer, const Chunking& chunking,
                    Scratch& scratch);

// As exchangeReduce, but peer's `received` lands in place, replacing buf's: no staging, and
// every chunk is posted at once. `sent` and `received` must be disjoint.
void exchangeCopy(Comm& comm, int peer, void* buf, const ElementRange& sent,
                  const ElementRange& received, size_t elementSize, const Chunking& chunking);

} // namespace torus
