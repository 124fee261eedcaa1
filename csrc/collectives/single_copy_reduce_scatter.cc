// Single-copy reduce-scatter through shared memory, n ranks on one host, S bytes in buf, block b
// of S_b bytes (evenly: S/n):
//   1. every rank announces its buffer's address;
//   2. rank r, one chunk of its block at a time, copies each peer's chunk into a cache-sized
//      scratch (process_vm_readv) and reduces it into its own buffer, peers in the order r+1,
//      r+2, ... so that no one rank's memory is everyone's first stop; a peer's buffer that lies
//      in its SharedTensorArena (mapped here) is reduced from where it lies, with no copy;
//   3. once it has reduced its whole block, it counts one delivery into each peer (done reading
//      its buffer) and waits for n-1 deliveries into itself, after which the caller may reuse
//      its buffer.
// Bytes copied per rank: S - S_r read (S(n-1)/n for even blocks), one copy each, no staging in
// shared memory; nothing written into peers. 2 synchronizations however large S, against the
// ring's n-1 steps of messages.
//
// Safe without more synchronization: rank r reads only block r of its peers' buffers, which
// nobody else reads or writes.
#include "collectives/single_copy_reduce_scatter.h"

#include <algorithm>
#include <numeric>

#include "collectives/shm_posting.h"

namespace torus {

namespace {

// Scratch and the reduced chunk both stay in the core's L2 cache. A block of 1 MiB or more goes
// in 128 KiB chunks: measured with 8 ranks on 2 cores, 64-128 KiB chunks came 5-10% closer to the
// memory's bound than 256 or 32 KiB (BENCHMARKS.md); a smaller block keeps fewer, larger copy
// calls, which its time feels.
constexpr size_t kChunkBytes = 256 * 1024;
constexpr size_t kLargeBlockBytes = 1024 * 1024;
constexpr size_t kLargeBlockChunkBytes = 128 * 1024;
// Where every peer's buffer is mapped here (no kernel copy per chunk to amortize), 32 KiB chunks
// took 6-7% less time than 128 KiB at 64 and 256 MiB with 8 ranks on 2 cores (BENCHMARKS.md).
constexpr size_t kMappedChunkBytes = 32 * 1024;

} // namespace

void reduceOwnBlockFromPeers(Comm& comm, SharedMemory& shm, const std::vector<SharedMemory::Posting>& postings,
                             void* buf, const Blocks& blocks, const Reducer& reducer, Scratch& scratch,
                             const std::function<void(const Chunk&)>& reduced) {
  const int n = comm.size();
  const int me = comm.rank();
  const size_t es = reducer.elementSize;
  char* base = static_cast<char*>(buf);
  const bool allMapped = std::all_of(postings.begin(), postings.end(), [&](const SharedMemory::Posting& posting) {
    return &posting == &postings[me] || posting.mapped != nullptr;
  });
  const size_t chunkBytes = allMapped                                       ? kMappedChunkBytes
                            : blocks.counts[me] * es >= kLargeBlockBytes ? kLargeBlockChunkBytes
                                                                         : kChunkBytes;
  const size_t chunkElements = std::max<size_t>(1, chunkBytes / es);
  char* staging = static_cast<char*>(scratch.get(chunkElements * es));
  std::vector<Chunk> chunks;
  appendChunks(chunks, blocks.offsets[me], blocks.counts[me], chunkElements);
  for (const Chunk& chunk : chunks) {
    const size_t offset = chunk.offset * es;
    for (int k = 1; k < n; ++k) {
      const int peer = (me + k) % n;
      if (const char* theirs = postings[peer].mapped) {
        shm.useMapped(peer, chunk.count * es, [&] { reducer(base + offset, theirs + offset, chunk.count); });
        continue;
      }
      shm.readPeer(peer, postings[peer].address + offset, staging, chunk.count * es);
      reducer(base + offset, staging, chunk.count);
    }
    if (reduced) {
      reduced(chunk);
    }
  }
}

void single_copy_reduce_scatter(Comm& comm, void* buf, const Blocks& blocks, const Reducer& reducer,
                                Scratch& scratch) {
  SharedMemory& shm = singleCopyMemory(comm, "single_copy reduce-scatter");
  const size_t elements = std::accumulate(blocks.counts.begin(), blocks.counts.end(), size_t{0});
  const auto postings = postAndGather(comm, shm, shm.beginCollective(), buf, elements * reducer.elementSize);
  reduceOwnBlockFromPeers(comm, shm, postings, buf, blocks, reducer, scratch, nullptr);
  finishWithPeers(comm, shm);
}

} // namespace torus
