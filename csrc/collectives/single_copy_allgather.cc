// Single-copy allgather through shared memory, n ranks on one host, S bytes in buf, block b of
// S_b bytes (evenly: S/n):
//   1. every rank announces its buffer's address;
//   2. rank r writes its block straight into the same place of every peer's buffer
//      (process_vm_writev, or a plain copy where the peer's buffer lies in its SharedTensorArena
//      and is mapped here), peers in the order r+1, r+2, ...;
//   3. it counts one delivery into each peer and waits for n-1 deliveries into itself: then
//      every block of its buffer holds its owner's.
// Bytes copied per rank: (n-1) S_r written (S(n-1)/n for even blocks), one copy each, no staging
// in shared memory and none in the receiver. 2 synchronizations however large S, against the
// ring's n-1 steps of messages.
//
// Safe without more synchronization: rank r writes only block r of its peers' buffers, which
// nobody else reads or writes once the peer has announced it (step 1).
#include "collectives/single_copy_allgather.h"

#include <cstring>
#include <numeric>

#include "collectives/shm_posting.h"

namespace torus {

void writeToPeers(Comm& comm, SharedMemory& shm, const std::vector<SharedMemory::Posting>& postings,
                  const void* buf, const Chunk& chunk, size_t elementSize) {
  const size_t offset = chunk.offset * elementSize;
  for (int k = 1; k < comm.size(); ++k) {
    const int peer = (comm.rank() + k) % comm.size();
    const char* mine = static_cast<const char*>(buf) + offset;
    const size_t nbytes = chunk.count * elementSize;
    if (char* theirs = postings[peer].mapped) {
      shm.useMapped(peer, nbytes, [&] { std::memcpy(theirs + offset, mine, nbytes); });
    } else {
      shm.writePeer(peer, postings[peer].address + offset, mine, nbytes);
    }
  }
}

void single_copy_allgather(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize) {
  SharedMemory& shm = singleCopyMemory(comm, "single_copy allgather");
  const size_t elements = std::accumulate(blocks.counts.begin(), blocks.counts.end(), size_t{0});
  const auto postings = postAndGather(comm, shm, shm.beginCollective(), buf, elements * elementSize);
  const int me = comm.rank();
  writeToPeers(comm, shm, postings, buf, Chunk{blocks.offsets[me], blocks.counts[me]}, elementSize);
  finishWithPeers(comm, shm);
}

} // namespace torus
