// Allgather through device arenas (ranks of one host, CUDA IPC), n ranks, S bytes in all.
//
// Each arena is two halves, used by alternate rounds. Round j: every rank copies piece j of its
// own block (at most half bytes) into its arena's half, waits for the copy and enters a barrier;
// then it copies piece j of every peer's block out of that peer's arena into its buffer and
// waits. Halves are reused as in arena_reduce_scatter, and a last barrier ends the collective.
//
// Steps: ceil(log2 n) empty messages per round, ceil(S_b / half) rounds for the largest block
// S_b. Bytes on the wire: none. Device memory traffic per rank: its block copied in, the other
// S(n-1)/n copied out of peers' arenas.
#include "collectives/device/arena_allgather.h"

#include <stdexcept>

#include "collectives/device/arena_rounds.h"
#include "collectives/device/device_barrier.h"

namespace torus {

void arena_allgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize) {
  const std::optional<ArenaView> view = comm.deviceArenas();
  if (!view) {
    throw std::invalid_argument("arena_allgather needs device arenas on every rank of the Comm");
  }
  const int n = comm.size();
  const int r = comm.rank();
  const size_t half = view->bytes / 2;
  const size_t pieceElements = half / elementSize;
  if (pieceElements == 0) {
    throw std::invalid_argument("device arenas are smaller than two elements");
  }
  const ArenaRounds rounds(blocks, pieceElements);
  char* bytes = static_cast<char*>(buf);
  for (size_t round = 0; round < rounds.count; ++round) {
    const size_t halfOffset = (round % 2) * half;
    if (const size_t count = rounds.piece(r, round)) {
      path.copy(view->arenas[r] + halfOffset, bytes + rounds.offset(r, round) * elementSize, count * elementSize);
    }
    const auto step = static_cast<int64_t>(round);
    path.synchronize(comm.deadline(), {"arena_allgather copy into the arena", step});
    device_barrier(comm, path, {"arena_allgather barrier after the copy", step});
    for (int p = 0; p < n; ++p) {
      const size_t count = p == r ? 0 : rounds.piece(p, round);
      if (count > 0) {
        path.copy(bytes + rounds.offset(p, round) * elementSize, view->arenas[p] + halfOffset, count * elementSize);
      }
    }
    path.synchronize(comm.deadline(), {"arena_allgather copy from the arenas", step});
  }
  device_barrier(comm, path, {"arena_allgather closing barrier"});
}

} // namespace torus
