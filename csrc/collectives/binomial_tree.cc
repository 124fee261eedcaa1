#include "collectives/binomial_tree.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace torus {

BinomialTree binomialTree(int rank, int size, int root) {
  if (root < 0 || root >= size) {
    throw std::invalid_argument("root " + std::to_string(root) + " is not a rank of a group of " +
                                std::to_string(size));
  }
  const int64_t n = size;
  const int64_t relative = (rank - root + n) % n;
  const auto toRank = [&](int64_t v) { return static_cast<int>((v + root) % n); };
  BinomialTree tree;
  for (int64_t bit = 1; bit < n; bit <<= 1) {
    if (relative & bit) {
      tree.parent = toRank(relative - bit);
      break;
    }
    if (relative + bit < n) {
      tree.children.push_back(toRank(relative + bit));
    }
  }
  return tree;
}

} // namespace torus
