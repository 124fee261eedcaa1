// Binomial-tree broadcast, n ranks, S bytes.
//
// Steps: ceil(log2 n). A rank receives from its parent and sends to each of its children (see
// binomial_tree.h): the root sends to ceil(log2 n) children, half the ranks are leaves.
// Bytes sent per rank: S times its number of children, so S ceil(log2 n) at the root, 0 at a
// leaf, S(n-1) in all; every rank but the root receives S.
// Messages: buf travels in chunks of at most chunkBytes. Every receive is posted at the start,
// straight into buf, and each chunk goes on to the children the moment it lands, largest subtree
// first, so a rank forwards chunk k while chunk k+1 is arriving and the tree's levels overlap:
// about ceil(log2 n) + (chunks - 1) chunk times on a tree of idle links.
#include "collectives/broadcast_binomial.h"

#include <vector>

#include "collectives/binomial_tree.h"
#include "collectives/blocks.h"

namespace torus {

void broadcast_binomial(Comm& comm, void* buf, size_t nbytes, int root, const Chunking& chunking) {
  const BinomialTree tree = binomialTree(comm.rank(), comm.size(), root);
  std::vector<Chunk> chunks;
  appendChunks(chunks, 0, nbytes, chunkElements(chunking, 1));
  char* bytes = static_cast<char*>(buf);

  std::vector<RequestPtr> receives;
  if (tree.parent >= 0) {
    receives.reserve(chunks.size());
    for (const Chunk& chunk : chunks) {
      receives.push_back(comm.irecv(tree.parent, bytes + chunk.offset, chunk.count));
    }
  }
  std::vector<RequestPtr> sends;
  sends.reserve(chunks.size() * tree.children.size());
  for (size_t k = 0; k < chunks.size(); ++k) {
    if (tree.parent >= 0) {
      comm.wait(receives[k]);
    }
    for (auto child = tree.children.rbegin(); child != tree.children.rend(); ++child) {
      sends.push_back(comm.isend(*child, bytes + chunks[k].offset, chunks[k].count));
    }
  }
  comm.waitAll(sends);
}

} // namespace torus
