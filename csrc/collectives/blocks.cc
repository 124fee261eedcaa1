#include "collectives/blocks.h"

#include <algorithm>

namespace torus {

Blocks evenBlocks(size_t count, int n) {
  const size_t ranks = static_cast<size_t>(n);
  const size_t base = count / ranks;
  const size_t larger = count % ranks;
  Blocks blocks;
  blocks.offsets.resize(ranks);
  blocks.counts.resize(ranks);
  size_t offset = 0;
  for (size_t i = 0; i < ranks; ++i) {
    blocks.offsets[i] = offset;
    blocks.counts[i] = base + (i < larger ? 1 : 0);
    offset += blocks.counts[i];
  }
  return blocks;
}

size_t largestCount(const Blocks& blocks) {
  return blocks.counts.empty() ? 0 : *std::max_element(blocks.counts.begin(), blocks.counts.end());
}

size_t spanOf(const Blocks& blocks) {
  size_t span = 0;
  for (size_t b = 0; b < blocks.counts.size(); ++b) {
    span = std::max(span, blocks.offsets[b] + blocks.counts[b]);
  }
  return span;
}

size_t chunkElements(const Chunking& chunking, size_t elementSize) {
  return std::max<size_t>(1, chunking.chunkBytes / elementSize);
}

void appendChunks(std::vector<Chunk>& chunks, size_t offset, size_t count, size_t maxElements) {
  for (size_t done = 0; done < count; done += maxElements) {
    chunks.push_back({offset + done, std::min(maxElements, count - done)});
  }
}

} // namespace torus
