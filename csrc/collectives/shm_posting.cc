#include "collectives/shm_posting.h"

#include <string>

namespace torus {

std::vector<ShmTransport::Posting> postAndGather(Comm& comm, ShmTransport& shm, uint64_t epoch, const void* buf,
                                                 size_t nbytes) {
  std::vector<ShmTransport::Posting> postings(static_cast<size_t>(comm.size()));
  const ShmTransport::Posting mine{epoch, reinterpret_cast<uint64_t>(buf), nbytes, comm.tag(), comm.call()};
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

} // namespace torus
