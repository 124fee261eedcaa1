#pragma once

#include <cstddef>
#include <vector>

#include "comm/comm.h"

namespace torus {

// Every rank's out (nbytes) receives its block of root's in, which holds n blocks of nbytes in
// rank order; in is unused on the other ranks. out may be root's own block of in.
void scatter_direct(Comm& comm, const void* in, void* out, size_t nbytes, int root);

// As scatter_direct with per-rank sizes: rank i's out (nbytes there) receives sendBytes[i] bytes
// from in + sendOffsets[i] on root. The size vectors are read on root only.
void scatterv_direct(Comm& comm, const void* in, const std::vector<size_t>& sendOffsets,
                     const std::vector<size_t>& sendBytes, void* out, size_t nbytes, int root);

} // namespace torus
