// Direct gather, n ranks, S bytes per rank.
//
// Steps: 1. Every rank but the root sends its S bytes straight to the root, which posts all n-1
// receives at once, into their places in out, and copies its own block meanwhile.
// Bytes sent per rank: S, the root none; the root receives S(n-1).
// Messages: one per rank, unchunked, empty ones included so that a rank whose size disagrees
// with the root's expectation gets a size-mismatch error rather than a hang.
#include "collectives/gather_direct.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace torus {

void gather_direct(Comm& comm, const void* in, size_t nbytes, void* out, int root) {
  const size_t n = static_cast<size_t>(comm.size());
  std::vector<size_t> offsets(n);
  for (size_t i = 0; i < n; ++i) {
    offsets[i] = i * nbytes;
  }
  gatherv_direct(comm, in, nbytes, out, offsets, std::vector<size_t>(n, nbytes), root);
}

void gatherv_direct(Comm& comm, const void* in, size_t nbytes, void* out,
                    const std::vector<size_t>& recvOffsets, const std::vector<size_t>& recvBytes,
                    int root) {
  if (comm.rank() != root) {
    comm.send(root, in, nbytes);
    return;
  }
  const int n = comm.size();
  if (recvOffsets.size() != static_cast<size_t>(n) || recvBytes.size() != static_cast<size_t>(n) ||
      recvBytes[root] != nbytes) {
    throw std::invalid_argument("gatherv over " + std::to_string(n) +
                                " ranks: receive layout does not match the ranks or the root's " +
                                std::to_string(nbytes) + " bytes");
  }
  char* bytes = static_cast<char*>(out);
  std::vector<RequestPtr> receives;
  receives.reserve(n - 1);
  for (int i = 0; i < n; ++i) {
    if (i != root) {
      receives.push_back(comm.irecv(i, bytes + recvOffsets[i], recvBytes[i]));
    }
  }
  // memmove: in may already be root's block of out. Empty buffers may be null, which the C
  // library functions do not accept even for zero bytes.
  if (nbytes > 0) {
    std::memmove(bytes + recvOffsets[root], in, nbytes);
  }
  comm.waitAll(receives);
}

} // namespace torus
