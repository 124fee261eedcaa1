// Ring allgather, n ranks, S bytes in buf, block b of S_b bytes (evenly: S/n).
//
// Steps: n-1. At step s rank r sends block (r-s) to rank r+1 and receives block (r-1-s) from
// rank r-1; after n-1 steps it has every block.
// Bytes sent per rank: S - S_(r+1), that is S(n-1)/n for even blocks; the same received.
// Messages: each step's block travels in chunks of at most chunkBytes, received straight into buf
// (every receive is posted at the start, no staging) and sent on as part of the next step the
// moment it lands, so the steps overlap.
#include "collectives/ring_allgather.h"

#include <limits>

#include "collectives/ring_pass.h"

namespace torus {

void ring_allgather(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize,
                    const Chunking& chunking) {
  char* bytes = static_cast<char*>(buf);
  // Chunks land in place and are final on arrival, so every receive can be posted at once.
  const size_t allReceives = std::numeric_limits<size_t>::max();
  ringPass(
      comm, buf, blocks, elementSize, chunking, comm.rank(), allReceives,
      [&](size_t, const Chunk& chunk) -> void* { return bytes + chunk.offset * elementSize; },
      [](size_t, const Chunk&) {});
}

} // namespace torus
