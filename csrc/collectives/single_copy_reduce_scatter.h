#pragma once

#include <functional>
#include <vector>

#include "collectives/blocks.h"
#include "comm/comm.h"
#include "reduce/reduce.h"
#include "transport/shared_memory.h"

namespace torus {

// As ring_reduce_scatter (block comm.rank() of buf ends reduced over all ranks; the others are
// left as they were), for a Comm whose ranks share memory with single-copy access
// (comm.sharedMemory()->singleCopy()). Staging: one chunk of scratch.
void single_copy_reduce_scatter(Comm& comm, void* buf, const Blocks& blocks, const Reducer& reducer,
                                Scratch& scratch);

// Its reduction, for algorithms that compose it (two_shot): given every rank's posting of buf
// (postAndGather), reduces block comm.rank() of every peer's buffer into buf one cache-sized chunk
// at a time, and calls `reduced` (if set) with each chunk once it is reduced, while it is still
// in cache.
void reduceOwnBlockFromPeers(Comm& comm, SharedMemory& shm, const std::vector<SharedMemory::Posting>& postings,
                             void* buf, const Blocks& blocks, const Reducer& reducer, Scratch& scratch,
                             const std::function<void(const Chunk&)>& reduced);

} // namespace torus
