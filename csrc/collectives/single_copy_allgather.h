#pragma once

#include <cstddef>
#include <vector>

#include "collectives/blocks.h"
#include "comm/comm.h"
#include "transport/shared_memory.h"

namespace torus {

// As ring_allgather (block comm.rank() of buf is this rank's contribution; on return every block
// holds its owner's), for a Comm whose ranks share memory with single-copy access
// (comm.sharedMemory()->singleCopy()). No staging.
void single_copy_allgather(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize);

// Its transfer, for algorithms that compose it (two_shot): given every rank's posting of buf
// (postAndGather), writes `chunk` of buf into the same place of every peer's buffer.
void writeToPeers(Comm& comm, SharedMemory& shm, const std::vector<SharedMemory::Posting>& postings,
                  const void* buf, const Chunk& chunk, size_t elementSize);

} // namespace torus
