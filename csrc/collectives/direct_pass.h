// One exchange between every pair of ranks at once, the part that direct reduce-scatter and
// direct allgather share.
#pragma once

#include <cstddef>
#include <functional>

#include "collectives/blocks.h"
#include "comm/comm.h"

namespace torus {

// Which block of buf a rank exchanges with a peer: the peer's block or its own.
enum class BlockOf { kPeer, kSelf };

// Where chunk k of what this rank receives from peer lands (counting from 0 per peer).
using PeerChunkLanding = std::function<void*(int peer, size_t k, const Chunk& chunk)>;
// Called once that chunk has landed, before its landing is handed out again.
using PeerChunkArrived = std::function<void(int peer, size_t k, const Chunk& chunk)>;

// One step: this rank sends block `sent` of buf (the peer's or its own) to every other rank and
// receives block `received` from each, every block cut into chunks (see chunkElements). Round k
// is chunk k to and from every peer, sending to rank + d while receiving from rank - d for
// d = 1..n-1, so that no rank is everyone's first. At most chunksInFlight rounds are posted
// ahead of the round being completed, which bounds the landing space a caller that stages its
// chunks needs to chunksInFlight x (n-1) chunks. Returns when every send and receive has
// completed.
void directPass(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize,
                const Chunking& chunking, BlockOf sent, BlockOf received, size_t chunksInFlight,
                const PeerChunkLanding& landing, const PeerChunkArrived& arrived);

} // namespace torus
