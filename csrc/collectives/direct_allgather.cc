// Direct allgather, n ranks, S bytes in buf, block b of S_b bytes (evenly: S/n).
//
// Steps: 1. Every rank sends its own block straight to every other rank and receives theirs.
// One step instead of the ring's n-1, at the price of n-1 peers sending to each rank at once.
// Bytes sent per rank: (n-1) S_r, that is S(n-1)/n for even blocks; S - S_r received.
// Messages: every block travels in chunks of at most chunkBytes, received straight into buf
// (every receive is posted at the start, no staging).
#include "collectives/direct_allgather.h"

#include <limits>

#include "collectives/direct_pass.h"

namespace torus {

void direct_allgather(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize,
                      const Chunking& chunking) {
  char* bytes = static_cast<char*>(buf);
  // Chunks land in place and are final on arrival, so every round can be posted at once.
  const size_t allRounds = std::numeric_limits<size_t>::max();
  directPass(
      comm, buf, blocks, elementSize, chunking, BlockOf::kSelf, BlockOf::kPeer, allRounds,
      [&](int, size_t, const Chunk& chunk) -> void* { return bytes + chunk.offset * elementSize; },
      [](int, size_t, const Chunk&) {});
}

} // namespace torus
