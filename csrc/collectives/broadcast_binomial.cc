// Binomial-tree broadcast, n ranks, S bytes.
//
// Steps: ceil(log2 n). A rank receives from its parent and sends to each of its children (see
// binomial_tree.h): the root sends to ceil(log2 n) children, half the ranks are leaves.
// Bytes sent per rank: S times its number of children, so S ceil(log2 n) at the root, 0 at a
// leaf, S(n-1) in all; every rank but the root receives S.
// Messages: buf travels in chunks of at most chunkBytes, each forwarded to the children the
// moment it lands (see tree_broadcast.h), largest subtree first since its deepest leaf is the
// farthest away, so a rank forwards chunk k while chunk k+1 is arriving and the tree's levels
// overlap: about ceil(log2 n) + (chunks - 1) chunk times on a tree of idle links.
#include "collectives/broadcast_binomial.h"

#include <vector>

#include "collectives/binomial_tree.h"
#include "collectives/tree_broadcast.h"

namespace torus {

void broadcast_binomial(Comm& comm, void* buf, size_t nbytes, int root, const Chunking& chunking) {
  const BinomialTree tree = binomialTree(comm.rank(), comm.size(), root);
  const std::vector<int> largestSubtreeFirst(tree.children.rbegin(), tree.children.rend());
  broadcastDownTree(comm, buf, nbytes, tree.parent, largestSubtreeFirst, chunking);
}

} // namespace torus
