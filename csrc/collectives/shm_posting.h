// What one_shot and two_shot allreduce announce before they touch each other's memory, and the
// check that every rank called the same collective with the same buffer size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "transport/shm/shm_transport.h"

namespace torus {

// Posts this rank's {buf, nbytes} and comm's call for `epoch` (from shm.beginCollective()) and
// waits for every peer's posting; throws CommError(kMismatch) naming both sides when a peer
// posted another call or byte count. Returns the postings indexed by rank (this rank's included).
std::vector<ShmTransport::Posting> postAndGather(Comm& comm, ShmTransport& shm, uint64_t epoch, const void* buf,
                                                 size_t nbytes);

} // namespace torus
