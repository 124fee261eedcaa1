// Two-shot allreduce by single copies between the ranks' own buffers, n ranks on one host,
// S bytes (evenBlocks: rank r owns block r): single_copy_reduce_scatter's reduction and
// single_copy_allgather's transfer, chunk by chunk, under one announcement:
//   1. every rank announces its buffer's address;
//   2. rank r, one chunk of its block at a time, copies each peer's chunk into a cache-sized
//      scratch (process_vm_readv) and reduces it into its own buffer, then writes the reduced
//      chunk straight into every peer's buffer (process_vm_writev) while it is still in cache;
//      where a peer's buffer lies in its SharedTensorArena (tensors from allocate_tensor), mapped
//      here, it reads and writes it with plain loads and stores instead, and reduces the peer's
//      chunk from where it lies;
//   3. once it has written its whole block, it counts one delivery into each peer, and waits
//      for n-1 deliveries into itself.
// Bytes copied per rank: (n-1)S/n read + (n-1)S/n written, one copy each, no staging in
// shared memory and no intermediate copy in the receiver; 2 synchronizations however large S
// (the two halves run one after the other would take 4). With mapped buffers the memory sees the
// least an allreduce can move: every rank's S read once and written once.
//
// Safe without more synchronization: rank r writes peer p's block r only after it has read it
// (chunk by chunk), and p reads nobody's copy of its own block but its own. A delivery from p
// means p has finished reading this rank's memory, so after n-1 deliveries the caller may
// reuse its buffer. Every block is reduced once, so every rank ends with the same bits.
#include "collectives/two_shot_allreduce.h"

#include "collectives/blocks.h"
#include "collectives/shm_posting.h"
#include "collectives/single_copy_allgather.h"
#include "collectives/single_copy_reduce_scatter.h"

namespace torus {

void two_shot_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer, const Chunking&,
                        Scratch& scratch) {
  SharedMemory& shm = singleCopyMemory(comm, "two_shot allreduce");
  const size_t elementSize = reducer.elementSize;
  const auto postings = postAndGather(comm, shm, shm.beginCollective(), buf, count * elementSize);
  reduceOwnBlockFromPeers(comm, shm, postings, buf, evenBlocks(count, comm.size()), reducer, scratch,
                          [&](const Chunk& chunk) { writeToPeers(comm, shm, postings, buf, chunk, elementSize); });
  finishWithPeers(comm, shm);
}

} // namespace torus
