// The binomial tree that broadcast and reduce run over.
#pragma once

#include <vector>

namespace torus {

// This rank's place in a binomial tree over ranks 0..size-1 rooted at root (comm ranks). In
// ranks relative to the root, rank v's parent is v with its lowest set bit cleared and its
// children are v + 2^j for every 2^j below that bit (every 2^j < size at the root), so the tree
// has depth ceil(log2 size) and child v + 2^j heads a subtree of up to 2^j ranks.
struct BinomialTree {
  int parent = -1; // -1 at the root
  std::vector<int> children; // smallest subtree first
};

BinomialTree binomialTree(int rank, int size, int root);

} // namespace torus
