// Direct reduce-scatter, n ranks, S bytes in buf, block b of S_b bytes (evenly: S/n).
//
// Steps: 1. Every rank sends block j straight to rank j, for every j but itself, and reduces the
// n-1 copies of its own block that arrive. One step instead of the ring's n-1, at the price of
// n-1 peers sending to each rank at once: the algorithm for few ranks or small blocks.
// Bytes sent per rank: S - S_r, that is S(n-1)/n for even blocks; rank r receives and reduces
// (n-1) S_r, the same S(n-1)/n.
// Messages: every block travels in chunks of at most chunkBytes; chunk k from every peer is
// reduced while the next rounds arrive (see direct_pass.h). Peers are reduced in the same order
// for every chunk, so the result does not depend on arrival order.
// Staging: ceil(kChunksInFlight / (n-1)) rounds of n-1 chunk-sized slots, fewer than
// kChunksInFlight + n - 1 chunks: at least kChunksInFlight receives in flight in all, and at
// least one per peer, so every peer's next chunk can land while another peer's is reduced.
#include "collectives/direct_reduce_scatter.h"

#include <algorithm>

#include "collectives/direct_pass.h"

namespace torus {

void direct_reduce_scatter(Comm& comm, void* buf, const Blocks& blocks, const Reducer& reducer,
                           const Chunking& chunking, Scratch& scratch) {
  const int self = comm.rank();
  const size_t elementSize = reducer.elementSize;
  const size_t peers = static_cast<size_t>(std::max(1, comm.size() - 1));
  const size_t window = (kChunksInFlight + peers - 1) / peers;
  const size_t slotBytes = std::min(chunkElements(chunking, elementSize), largestCount(blocks)) * elementSize;
  char* staging = static_cast<char*>(scratch.get(window * peers * slotBytes));
  // Chunk k from a peer lands in slot (k % window, the peer's index among the others).
  const auto slot = [=](int peer, size_t k) {
    const size_t other = static_cast<size_t>(peer < self ? peer : peer - 1);
    return staging + ((k % window) * peers + other) * slotBytes;
  };
  char* bytes = static_cast<char*>(buf);
  directPass(
      comm, buf, blocks, elementSize, chunking, BlockOf::kPeer, BlockOf::kSelf, window,
      [&](int peer, size_t k, const Chunk&) -> void* { return slot(peer, k); },
      [&](int peer, size_t k, const Chunk& chunk) {
        reducer(bytes + chunk.offset * elementSize, slot(peer, k), chunk.count);
      });
}

} // namespace torus
