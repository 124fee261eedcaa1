// Shared-memory barrier, n ranks on one host: every rank announces its arrival to each peer in
// its own posting cell, then waits for every peer's announcement.
//
// Steps: 1. Per rank: n - 1 posting cells written and n - 1 doorbells rung; no bytes move. The
// last rank to arrive releases all the others at once, so they leave within one wake-up of each
// other; the dissemination barrier's ceil(log2 n) rounds of messages each cost the receiver a
// wake-up on a host whose ranks outnumber its cores, and let ranks leave rounds apart. The
// postings carry the call, so a rank that called another collective is named as in any shm
// collective.
#include "collectives/barrier_shared_memory.h"

#include <stdexcept>

#include "collectives/shm_posting.h"

namespace torus {

void barrier_shared_memory(Comm& comm) {
  SharedMemory* shm = comm.sharedMemory();
  if (shm == nullptr) {
    throw std::logic_error("torus: the shared_memory barrier needs shared memory");
  }
  // The address is only there so that no posting names a null buffer.
  const char arrived = 0;
  postAndGather(comm, *shm, shm->beginCollective(), &arrived, 0);
}

} // namespace torus
