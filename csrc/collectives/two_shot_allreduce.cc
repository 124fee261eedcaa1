// Two-shot allreduce by single copies between the ranks' own buffers, n ranks on one host,
// S bytes (evenBlocks: rank r owns block r):
//   1. every rank announces its buffer's address;
//   2. rank r, one chunk of its block at a time, copies each peer's chunk into a cache-sized
//      scratch (process_vm_readv) and reduces it into its own buffer, then writes the reduced
//      chunk straight into every peer's buffer (process_vm_writev) while it is still in cache;
//   3. once it has written its whole block, it counts one delivery into each peer, and waits
//      for n-1 deliveries into itself.
// Bytes copied per rank: (n-1)S/n read + (n-1)S/n written, one copy each, no staging in
// shared memory and no intermediate copy in the receiver; 2 synchronizations however large S.
//
// Safe without more synchronization: rank r writes peer p's block r only after it has read it
// (chunk by chunk), and p reads nobody's copy of its own block but its own. A delivery from p
// means p has finished reading this rank's memory, so after n-1 deliveries the caller may
// reuse its buffer. Every block is reduced once, so every rank ends with the same bits.
#include "collectives/two_shot_allreduce.h"

#include <algorithm>

#include "collectives/blocks.h"
#include "collectives/shm_posting.h"

namespace torus {

namespace {

// Scratch and the reduced chunk both stay in the core's L2 cache.
constexpr size_t kChunkBytes = 256 * 1024;

} // namespace

void two_shot_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer, const Chunking&,
                        Scratch& scratch) {
  SharedMemory& shm = singleCopyMemory(comm, "two_shot allreduce");
  const int n = comm.size();
  const int me = comm.rank();
  const size_t es = reducer.elementSize;
  const auto postings = postAndGather(comm, shm, shm.beginCollective(), buf, count * es);
  const Blocks blocks = evenBlocks(count, n);
  char* base = static_cast<char*>(buf);
  const size_t chunkElements = std::max<size_t>(1, kChunkBytes / es);
  char* staging = static_cast<char*>(scratch.get(chunkElements * es));
  const size_t end = blocks.offsets[me] + blocks.counts[me];
  for (size_t at = blocks.offsets[me]; at < end; at += chunkElements) {
    const size_t elements = std::min(chunkElements, end - at);
    const size_t offset = at * es;
    const size_t bytes = elements * es;
    // Peers in a different order on every rank, so that no one rank's memory is everyone's
    // first stop.
    for (int k = 1; k < n; ++k) {
      const int peer = (me + k) % n;
      shm.readPeer(peer, postings[peer].address + offset, staging, bytes);
      reducer(base + offset, staging, elements);
    }
    for (int k = 1; k < n; ++k) {
      const int peer = (me + k) % n;
      shm.writePeer(peer, postings[peer].address + offset, base + offset, bytes);
    }
  }
  finishWithPeers(comm, shm);
}

} // namespace torus
