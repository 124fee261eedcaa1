#include "collectives/shm_posting.h"

#include <stdexcept>
#include <string>

namespace torus {

SharedMemory& singleCopyMemory(Comm& comm, const char* algorithm) {
  SharedMemory* shm = comm.sharedMemory();
  if (shm == nullptr || !shm->singleCopy()) {
    throw std::logic_error(std::string("torus: ") + algorithm + " needs shared memory with single-copy access");
  }
  return *shm;
}

std::vector<SharedMemory::Posting> postAndGather(Comm& comm, SharedMemory& shm, uint64_t epoch, const void* buf,
                                                 size_t nbytes) {
  std::vector<SharedMemory::Posting> postings(static_cast<size_t>(comm.size()));
  const SharedMemory::Posting mine{epoch, reinterpret_cast<uint64_t>(buf), nbytes, comm.tag(), comm.call()};
  postings[comm.rank()] = mine;
  shm.post(mine);
  for (int k = 1; k < comm.size(); ++k) {
    const int peer = (comm.rank() + k) % comm.size();
    postings[peer] = shm.waitPosted(peer, mine, comm.deadline());
    if (!mine.call.agreesWith(postings[peer].call) || postings[peer].nbytes != nbytes) {
      throw CommError(CommError::Kind::kMismatch,
                      "rank " + std::to_string(peer) + " posted " + std::to_string(postings[peer].nbytes) +
                          " bytes where this rank posted " + std::to_string(nbytes),
                      CallMismatch{comm.transportRank(peer), comm.tag(), mine.call, postings[peer].call});
    }
  }
  return postings;
}

void finishWithPeers(Comm& comm, SharedMemory& shm) {
  for (int k = 1; k < comm.size(); ++k) {
    shm.signalDelivered((comm.rank() + k) % comm.size());
  }
  shm.waitDeliveries(comm.deadline());
}

} // namespace torus
