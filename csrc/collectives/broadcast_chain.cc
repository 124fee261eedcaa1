// Pipelined chain broadcast, n ranks, S bytes in C chunks of at most chunkBytes.
//
// Steps: n-1 + C-1 chunk times. The root sends to root+1, which forwards to root+2, and so on to
// root+n-1 (mod n); every rank forwards chunk k while receiving chunk k+1 (see tree_broadcast.h),
// so once the pipeline is full every link carries a chunk at once. Against the binomial tree's
// ceil(log2 n) + C-1: more latency, but each rank sends S once instead of the root sending it
// ceil(log2 n) times, so for large S it moves at the speed of one link.
// Bytes sent per rank: S, except the last rank of the chain, which sends nothing; every rank but
// the root receives S.
#include "collectives/broadcast_chain.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/tree_broadcast.h"

namespace torus {

void broadcast_chain(Comm& comm, void* buf, size_t nbytes, int root, const Chunking& chunking) {
  const int n = comm.size();
  if (root < 0 || root >= n) {
    throw std::invalid_argument("root " + std::to_string(root) + " is not a rank of a group of " +
                                std::to_string(n));
  }
  const int rank = comm.rank();
  const bool last = (rank + 1) % n == root;
  broadcastDownTree(comm, buf, nbytes, rank == root ? -1 : (rank - 1 + n) % n,
                    last ? std::vector<int>{} : std::vector<int>{(rank + 1) % n}, chunking);
}

} // namespace torus
