// One-shot allreduce through shared memory (the latency-bound case), n ranks on one host,
// S bytes: every rank copies its buffer into its own slot of shared memory, announces it, and,
// once all have, reduces all n slots into its buffer, in rank order, so every rank computes the
// same bits; then it releases the peers' slots.
//
// Steps: 1 (one wait for every rank's announcement). Bytes copied per rank: S in, then reads of
// n*S: cheapest when S is small and a second round of synchronization would cost more than
// the redundant reduction. Slots alternate between two per rank, so its next collective can fill
// one while slow peers still read this one's; a rank fills a slot again only once every reader
// of its previous use has released it, which in a group that runs only this Comm's collectives
// it always has (a rank begins its collective after next only once every peer has posted in its
// next one, after finishing this one) and in a Comm over some of a group's ranks (a torus row)
// it waits for.
#include "collectives/one_shot_allreduce.h"

#include <cstring>
#include <stdexcept>

#include "collectives/shm_posting.h"

namespace torus {

void one_shot_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer, const Chunking&, Scratch&) {
  SharedMemory* shm = comm.sharedMemory();
  const size_t nbytes = count * reducer.elementSize;
  if (shm == nullptr || nbytes > SharedMemory::kSlotBytes) {
    throw std::logic_error("torus: one_shot allreduce needs shared memory and at most " +
                           std::to_string(SharedMemory::kSlotBytes) + " bytes");
  }
  const uint64_t epoch = shm->beginCollective();
  char* mine = shm->claimSlot(epoch, comm.deadline());
  std::memcpy(mine, buf, nbytes);
  const auto postings = postAndGather(comm, *shm, epoch, mine, nbytes);
  std::memcpy(buf, shm->slot(0, postings[0].epoch), nbytes);
  for (int r = 1; r < comm.size(); ++r) {
    reducer(buf, shm->slot(r, postings[r].epoch), count);
  }
  for (int k = 1; k < comm.size(); ++k) {
    const int peer = (comm.rank() + k) % comm.size();
    shm->releaseSlot(peer, postings[peer].epoch);
  }
}

} // namespace torus
