// How collectives cut a buffer: into one block per comm rank (what each rank owns in a
// reduce-scatter or allgather), and each transfer into chunks of at most one message.
#pragma once

#include <cstddef>
#include <vector>

#include "comm/comm.h"

namespace torus {

// One block per comm rank, in elements: block i is [offsets[i], offsets[i] + counts[i]) of the
// buffer. Blocks may be empty, uneven and in any order; they must not overlap.
struct Blocks {
  std::vector<size_t> offsets;
  std::vector<size_t> counts;
};

// count elements cut into n consecutive blocks as evenly as possible: the first count % n blocks
// are one element larger.
Blocks evenBlocks(size_t count, int n);

// The largest block's element count (0 for no blocks).
size_t largestCount(const Blocks& blocks);
// The elements the blocks reach into: the end of the block that ends last.
size_t spanOf(const Blocks& blocks);

// A piece of a buffer that travels as one message, in elements.
struct Chunk {
  size_t offset;
  size_t count;
};

// The most elements one message may carry: chunking.chunkBytes rounded down to whole elements,
// but at least one element, so that a chunk size below the element size still makes progress.
size_t chunkElements(const Chunking& chunking, size_t elementSize);

// Appends [offset, offset + count) cut into chunks of at most maxElements each (none when count
// is 0). Both ends of a transfer call it with the same arguments, so they agree on every
// message's size without sending it.
void appendChunks(std::vector<Chunk>& chunks, size_t offset, size_t count, size_t maxElements);

// How many chunks a pipelined algorithm keeps in flight per peer it receives from, each in its
// own chunk-sized staging slot: enough for the transfer of the next chunks to overlap the
// reduction of this one, while staging stays a few chunks however large the buffer.
constexpr size_t kChunksInFlight = 4;

} // namespace torus
