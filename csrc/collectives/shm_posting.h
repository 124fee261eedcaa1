// What the shared-memory collectives share: the announcements they make before they touch each
// other's memory, with the check that every rank called the same collective with the same buffer
// size, and the end at which every rank knows its peers are done with its buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "transport/shared_memory.h"

namespace torus {

// comm's shared memory, which must offer single copies; throws std::logic_error naming
// `algorithm` otherwise.
SharedMemory& singleCopyMemory(Comm& comm, const char* algorithm);

// Posts this rank's {buf, nbytes} and comm's call for `epoch` (from shm.beginCollective()) and
// waits for every peer's posting; throws CommError(kMismatch) naming both sides when a peer
// posted another call or byte count. Returns the postings indexed by rank (this rank's included).
std::vector<SharedMemory::Posting> postAndGather(Comm& comm, SharedMemory& shm, uint64_t epoch, const void* buf,
                                                 size_t nbytes);

// Tells every peer that this rank is done with its buffer and waits until every peer is done
// with this rank's: the caller may reuse its buffer, and holds every peer's writes into it.
void finishWithPeers(Comm& comm, SharedMemory& shm);

} // namespace torus
