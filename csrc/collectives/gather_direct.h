#pragma once

#include <cstddef>
#include <vector>

#include "comm/comm.h"

namespace torus {

// On root, out receives every rank's in (nbytes each) in rank order, root's own copied locally;
// out is unused on the other ranks. in may be root's own block of out.
void gather_direct(Comm& comm, const void* in, size_t nbytes, void* out, int root);

// As gather_direct with per-rank sizes: rank i's in (nbytes there) lands at out + recvOffsets[i]
// on root and must be recvBytes[i] long. The size vectors are read on root only.
void gatherv_direct(Comm& comm, const void* in, size_t nbytes, void* out,
                    const std::vector<size_t>& recvOffsets, const std::vector<size_t>& recvBytes,
                    int root);

} // namespace torus
