// How the arena collectives cut their blocks into rounds: in round j every block's piece j
// (elements [j * pieceElements, (j + 1) * pieceElements) of the block, fewer or none at its end)
// goes through one arena half.
#pragma once

#include <algorithm>
#include <cstddef>

#include "collectives/blocks.h"

namespace torus {

struct ArenaRounds {
  ArenaRounds(const Blocks& blocks, size_t pieceElements)
      : blocks(blocks),
        pieceElements(pieceElements),
        count((largestCount(blocks) + pieceElements - 1) / pieceElements) {}

  // The elements of block `block`'s piece in round `round`.
  size_t piece(int block, size_t round) const {
    const size_t start = round * pieceElements;
    return start >= blocks.counts[block] ? 0 : std::min(pieceElements, blocks.counts[block] - start);
  }
  // The element offset in the buffer of that piece.
  size_t offset(int block, size_t round) const {
    return blocks.offsets[block] + round * pieceElements;
  }

  const Blocks& blocks;
  const size_t pieceElements;
  // How many rounds: enough for the largest block.
  const size_t count;
};

} // namespace torus
