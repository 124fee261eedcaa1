// Binomial-tree reduce, n ranks, S bytes: broadcast_binomial run backwards.
//
// Steps: ceil(log2 n). A rank receives its children's partial reductions (see binomial_tree.h),
// reduces them into buf, and sends the result to its parent.
// Bytes sent per rank: S, except the root, which sends nothing; a rank receives and reduces S
// times its number of children (S ceil(log2 n) at the root).
// Messages: buf travels in chunks of at most chunkBytes. Receives for the next kChunksInFlight
// chunks from every child are posted into scratch staging; chunk k goes to the parent as soon as
// every child's chunk k is reduced into buf, while chunks k+1... are arriving, so the levels of
// the tree overlap. Staging: kChunksInFlight x children chunk-sized slots. Sends go straight from
// buf: a chunk is sent only once fully reduced, and never written again.
#include "collectives/reduce_binomial.h"

#include <algorithm>
#include <vector>

#include "collectives/binomial_tree.h"
#include "collectives/blocks.h"

namespace torus {

void reduce_binomial(Comm& comm, void* buf, size_t count, const Reducer& reducer, int root,
                     const Chunking& chunking, Scratch& scratch) {
  const BinomialTree tree = binomialTree(comm.rank(), comm.size(), root);
  const size_t elementSize = reducer.elementSize;
  const size_t maxElements = chunkElements(chunking, elementSize);
  std::vector<Chunk> chunks;
  appendChunks(chunks, 0, count, maxElements);

  // Chunk k from child c lands in slot (k % window, c), free again once reduced.
  const size_t fanIn = tree.children.size();
  const size_t window = std::min(kChunksInFlight, chunks.size());
  const size_t slotBytes = std::min(maxElements, count) * elementSize;
  char* staging = static_cast<char*>(scratch.get(window * fanIn * slotBytes));
  const auto slot = [fanIn, window](size_t k, size_t c) { return (k % window) * fanIn + c; };
  std::vector<RequestPtr> receives(window * fanIn);
  const auto post = [&](size_t k) {
    for (size_t c = 0; c < fanIn; ++c) {
      receives[slot(k, c)] = comm.irecv(tree.children[c], staging + slot(k, c) * slotBytes,
                                        chunks[k].count * elementSize);
    }
  };

  for (size_t k = 0; k < window; ++k) {
    post(k);
  }
  char* bytes = static_cast<char*>(buf);
  std::vector<RequestPtr> sends;
  sends.reserve(tree.parent >= 0 ? chunks.size() : 0);
  for (size_t k = 0; k < chunks.size(); ++k) {
    char* chunk = bytes + chunks[k].offset * elementSize;
    // Smallest subtree first: its partial reduction is the first to be ready.
    for (size_t c = 0; c < fanIn; ++c) {
      comm.wait(receives[slot(k, c)]);
      reducer(chunk, staging + slot(k, c) * slotBytes, chunks[k].count);
    }
    if (k + window < chunks.size()) {
      post(k + window);
    }
    if (tree.parent >= 0) {
      sends.push_back(comm.isend(tree.parent, chunk, chunks[k].count * elementSize));
    }
  }
  comm.waitAll(sends);
}

} // namespace torus
