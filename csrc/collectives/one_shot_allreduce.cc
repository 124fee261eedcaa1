// One-shot allreduce through shared memory (the latency-bound case), n ranks on one host,
// S bytes: every rank copies its buffer into its own slot of shared memory, announces it, and,
// once all have, reduces all n slots into its buffer, in rank order, so every rank computes the
// same bits.
//
// Steps: 1 (one wait for every rank's announcement). Bytes copied per rank: S in, then reads of
// n*S: cheapest when S is small and a second round of synchronization would cost more than
// the redundant reduction. Slots alternate between two per rank, so epoch e+1 can fill one while
// slow peers still read epoch e's; a rank cannot reach e+2 before every peer has finished e,
// because it waits for every peer's announcement of e+1, made after that peer finished e.
#include "collectives/one_shot_allreduce.h"

#include <cstring>
#include <stdexcept>

#include "collectives/shm_posting.h"
#include "transport/shm/shm_transport.h"

namespace torus {

void one_shot_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer, const Chunking&, Scratch&) {
  ShmTransport* shm = comm.sharedMemory();
  const size_t nbytes = count * reducer.elementSize;
  if (shm == nullptr || nbytes > ShmTransport::kSlotBytes) {
    throw std::logic_error("torus: one_shot allreduce needs shared memory and at most " +
                           std::to_string(ShmTransport::kSlotBytes) + " bytes");
  }
  const uint64_t epoch = shm->beginCollective();
  char* mine = shm->slot(comm.rank(), epoch);
  std::memcpy(mine, buf, nbytes);
  postAndGather(comm, *shm, epoch, mine, nbytes);
  std::memcpy(buf, shm->slot(0, epoch), nbytes);
  for (int r = 1; r < comm.size(); ++r) {
    reducer(buf, shm->slot(r, epoch), count);
  }
}

} // namespace torus
