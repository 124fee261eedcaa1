// Reduce-scatter through device arenas (ranks of one host, CUDA IPC), n ranks, S bytes.
//
// Each arena is two halves, used by alternate rounds. Round j: every rank copies piece j of each
// of its n blocks (at most half/n bytes each) into its own arena's half, waits for the copy, and
// enters a barrier; then rank r reduces piece j of block r from all n arenas, in rank order, with
// one kernel straight into its buffer, and waits for it. A rank writes a half again two rounds
// later, after the next round's barrier, which every rank enters only once done reading it; a
// last barrier lets the next collective start on clean arenas.
//
// Steps: ceil(log2 n) empty messages per round (the barrier), ceil(S / half) rounds. Bytes on
// the wire: none. Device memory traffic per rank: S copied into its arena, S read and S/n written
// by its kernel; every piece is reduced by one rank, in one order, so all ranks agree bit for bit.
#include "collectives/device/arena_reduce_scatter.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/device/arena_rounds.h"
#include "collectives/device/device_barrier.h"

namespace torus {

void arena_reduce_scatter(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, const Blocks& blocks) {
  const std::optional<ArenaView> view = comm.deviceArenas();
  if (!view) {
    throw std::invalid_argument("arena_reduce_scatter needs device arenas on every rank of the Comm");
  }
  const int n = comm.size();
  const int r = comm.rank();
  const size_t elementSize = torus::elementSize(op.dtype);
  const size_t half = view->bytes / 2;
  const size_t pieceElements = half / static_cast<size_t>(n) / elementSize;
  if (pieceElements == 0) {
    throw std::invalid_argument("device arenas of " + std::to_string(view->bytes) + " bytes are too small for " +
                                std::to_string(n) + " ranks");
  }
  const ArenaRounds rounds(blocks, pieceElements);
  char* bytes = static_cast<char*>(buf);
  std::vector<const void*> sources(static_cast<size_t>(n));
  for (size_t round = 0; round < rounds.count; ++round) {
    const size_t halfOffset = (round % 2) * half;
    char* mine = view->arenas[r] + halfOffset;
    for (int b = 0; b < n; ++b) {
      if (const size_t count = rounds.piece(b, round)) {
        path.copy(mine + b * pieceElements * elementSize, bytes + rounds.offset(b, round) * elementSize,
                  count * elementSize);
      }
    }
    const auto step = static_cast<int64_t>(round);
    path.synchronize(comm.deadline(), {"arena_reduce_scatter copy into the arena", step});
    device_barrier(comm, path, {"arena_reduce_scatter barrier after the copy", step});
    if (const size_t count = rounds.piece(r, round)) {
      for (int p = 0; p < n; ++p) {
        sources[p] = view->arenas[p] + halfOffset + r * pieceElements * elementSize;
      }
      path.reduce(op, bytes + rounds.offset(r, round) * elementSize, sources.data(), n, count);
    }
    path.synchronize(comm.deadline(), {"arena_reduce_scatter reduce", step});
  }
  device_barrier(comm, path, {"arena_reduce_scatter closing barrier"});
}

} // namespace torus
