// Dissemination barrier (Hensgen, Finkel and Manber), n ranks.
//
// Steps: ceil(log2 n). In round k rank r signals rank (r + 2^k) while waiting for the signal of
// rank (r - 2^k), full duplex. After round k every rank has heard, directly or through others,
// from the 2^(k+1) - 1 ranks before it, so after the last round from all of them; unlike a
// tree barrier no rank gathers and re-broadcasts, and every round is one message each way.
// Bytes sent per rank: none; ceil(log2 n) empty messages.
#include "collectives/barrier_dissemination.h"

#include <cstdint>

namespace torus {

void barrier_dissemination(Comm& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  // Empty messages carry the signal; the address is only there so no buffer is null.
  char signal = 0;
  for (int64_t distance = 1; distance < n; distance *= 2) {
    comm.sendRecv(static_cast<int>((r + distance) % n), &signal, 0,
                  static_cast<int>((r - distance + n) % n), &signal, 0);
  }
}

} // namespace torus
