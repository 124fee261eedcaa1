#pragma once

#include <cstddef>
#include <vector>

#include "collectives/allreduce.h"
#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// An r x c arrangement of a Comm's ranks: rows[i][j] is the comm rank at row i, column j. Every
// row has the same length c, every rank of the Comm appears exactly once, and column j is
// rows[i][j] over i.
struct TorusGrid {
  std::vector<std::vector<int>> rows;
};

// The comm ranks of a rank's row and column, in grid order.
struct GridLines {
  std::vector<int> row;
  std::vector<int> column;
};
// Throws std::invalid_argument when grid does not arrange `size` ranks as above.
GridLines linesThrough(const TorusGrid& grid, int size, int rank);

// In place: on return buf (count elements of reducer.elementSize) holds the reduction over all
// ranks of comm, reduce-scattered along this rank's row, allreduced along its column with
// `inner`, and allgathered along the row. Throws std::invalid_argument when grid does not arrange
// comm's ranks as above. Staging comes from scratch, which must not overlap buf; the column phase
// may run on a thread of its own, with scratch of its own.
void torus_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                     const TorusGrid& grid, AllreduceFn inner, const Chunking& chunking,
                     Scratch& scratch);

} // namespace torus
