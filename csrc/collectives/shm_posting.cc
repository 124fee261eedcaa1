#include "collectives/shm_posting.h"

#include <string>

namespace torus {

namespace {

uint64_t signatureOf(ShmCollective collective, size_t elementSize) {
  return static_cast<uint64_t>(collective) << 32 | elementSize;
}

std::string describe(uint64_t signature, uint64_t nbytes) {
  const auto collective = static_cast<ShmCollective>(signature >> 32);
  const char* name = collective == ShmCollective::kOneShotAllreduce   ? "one_shot allreduce"
                     : collective == ShmCollective::kTwoShotAllreduce ? "two_shot allreduce"
                                                                      : "an unknown collective";
  return std::string(name) + " of " + std::to_string(nbytes) + " bytes (" +
         std::to_string(signature & 0xffffffffu) + "-byte elements)";
}

} // namespace

std::vector<ShmTransport::Posting> postAndGather(Comm& comm, ShmTransport& shm, uint64_t epoch,
                                                 ShmCollective collective, const void* buf, size_t nbytes,
                                                 size_t elementSize) {
  const uint64_t signature = signatureOf(collective, elementSize);
  std::vector<ShmTransport::Posting> postings(static_cast<size_t>(comm.size()));
  postings[comm.rank()] = {epoch, reinterpret_cast<uint64_t>(buf), nbytes, signature};
  shm.post(postings[comm.rank()]);
  for (int k = 1; k < comm.size(); ++k) {
    const int peer = (comm.rank() + k) % comm.size();
    postings[peer] = shm.waitPosted(peer, epoch, comm.deadline());
    if (postings[peer].signature != signature || postings[peer].nbytes != nbytes) {
      throw CommError(CommError::Kind::kMismatch,
                      "ranks called different collectives: rank " + std::to_string(comm.rank()) + " runs " +
                          describe(signature, nbytes) + ", rank " + std::to_string(peer) + " runs " +
                          describe(postings[peer].signature, postings[peer].nbytes));
    }
  }
  return postings;
}

} // namespace torus
