// Direct scatter, n ranks, S bytes per rank.
//
// Steps: 1. The root sends every other rank its block straight from in, all n-1 sends posted at
// once, and copies its own block meanwhile.
// Bytes sent per rank: the root S(n-1), the others none; every rank but the root receives S.
// Messages: one per rank, unchunked, empty ones included so that a rank whose size disagrees
// with the root's gets a size-mismatch error rather than a hang.
#include "collectives/scatter_direct.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace torus {

void scatter_direct(Comm& comm, const void* in, void* out, size_t nbytes, int root) {
  const size_t n = static_cast<size_t>(comm.size());
  std::vector<size_t> offsets(n);
  for (size_t i = 0; i < n; ++i) {
    offsets[i] = i * nbytes;
  }
  scatterv_direct(comm, in, offsets, std::vector<size_t>(n, nbytes), out, nbytes, root);
}

void scatterv_direct(Comm& comm, const void* in, const std::vector<size_t>& sendOffsets,
                     const std::vector<size_t>& sendBytes, void* out, size_t nbytes, int root) {
  if (comm.rank() != root) {
    comm.recv(root, out, nbytes);
    return;
  }
  const int n = comm.size();
  if (sendOffsets.size() != static_cast<size_t>(n) || sendBytes.size() != static_cast<size_t>(n) ||
      sendBytes[root] != nbytes) {
    throw std::invalid_argument("scatterv over " + std::to_string(n) +
                                " ranks: send layout does not match the ranks or the root's " +
                                std::to_string(nbytes) + " bytes");
  }
  const char* bytes = static_cast<const char*>(in);
  std::vector<RequestPtr> sends;
  sends.reserve(n - 1);
  for (int i = 0; i < n; ++i) {
    if (i != root) {
      sends.push_back(comm.isend(i, bytes + sendOffsets[i], sendBytes[i]));
    }
  }
  // memmove: out may already be root's block of in. Empty buffers may be null, which the C
  // library functions do not accept even for zero bytes.
  if (nbytes > 0) {
    std::memmove(out, bytes + sendOffsets[root], nbytes);
  }
  comm.waitAll(sends);
}

} // namespace torus
