// Pairwise-exchange alltoallv, n ranks, rank r sending S_rj bytes to rank j.
//
// Steps: n-1. At step k rank r sends its block for rank (r+k) while receiving the block from
// rank (r-k), full duplex; its own block is copied locally. Each step pairs every rank with one
// sender and one receiver, so no rank is flooded by n-1 senders at once.
// Bytes sent per rank: the sum of S_rj over j != r (evenly, S(n-1)/n of an S-byte input).
// Messages: one per step, unchunked, empty ones included so that ranks disagreeing on a size get
// a size-mismatch error rather than a hang.
#include "collectives/alltoallv_pairwise.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace torus {

void alltoallv_pairwise(Comm& comm, const void* in, const std::vector<size_t>& sendOffsets,
                        const std::vector<size_t>& sendBytes, void* out,
                        const std::vector<size_t>& recvOffsets,
                        const std::vector<size_t>& recvBytes) {
  const int n = comm.size();
  const int r = comm.rank();
  const size_t ranks = static_cast<size_t>(n);
  if (sendOffsets.size() != ranks || sendBytes.size() != ranks || recvOffsets.size() != ranks ||
      recvBytes.size() != ranks) {
    throw std::invalid_argument("alltoallv over " + std::to_string(n) +
                                " ranks given layouts of another length");
  }
  if (sendBytes[r] != recvBytes[r]) {
    throw std::invalid_argument("alltoallv: rank " + std::to_string(r) + " sends itself " +
                                std::to_string(sendBytes[r]) + " bytes but expects " +
                                std::to_string(recvBytes[r]));
  }
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // Empty buffers may be null, which memcpy does not accept even for zero bytes.
  if (sendBytes[r] > 0) {
    std::memcpy(dst + recvOffsets[r], src + sendOffsets[r], sendBytes[r]);
  }
  for (int k = 1; k < n; ++k) {
    const int to = (r + k) % n;
    const int from = (r - k + n) % n;
    comm.sendRecv(to, src + sendOffsets[to], sendBytes[to], from, dst + recvOffsets[from],
                  recvBytes[from]);
  }
}

} // namespace torus
