// One pass around a ring, the part that ring reduce-scatter and ring allgather share.
#pragma once

#include <cstddef>
#include <functional>

#include "collectives/blocks.h"
#include "comm/comm.h"

namespace torus {

// Where the chunk this rank receives `index`-th (counting from 0 over the whole pass) lands.
using ChunkLanding = std::function<void*(size_t index, const Chunk& chunk)>;
// Called once that chunk has landed, before it is forwarded from buf and before its landing is
// handed out again.
using ChunkArrived = std::function<void(size_t index, const Chunk& chunk)>;

// n-1 steps on comm's ring: at step s this rank sends block (firstSendBlock - s) of buf to rank + 1
// and receives block (firstSendBlock - s - 1) from rank - 1 (mod n). Each block is cut into chunks
// (see chunkElements); every chunk received before the last step is the next step's send, so it is
// sent on from buf once `arrived` returns and this rank's first block (which the next rank expects
// first, and which goes out paced by arrivals) has been sent: later chunks keep arriving meanwhile,
// and the steps overlap. At most receivesInFlight receives are posted at a time, which bounds the
// landing space a caller that stages its chunks needs. Returns when every send and receive has
// completed.
void ringPass(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize,
              const Chunking& chunking, int firstSendBlock, size_t receivesInFlight,
              const ChunkLanding& landing, const ChunkArrived& arrived);

} // namespace torus
