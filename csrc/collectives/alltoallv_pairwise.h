#pragma once

#include <cstddef>
#include <vector>

#include "comm/comm.h"

namespace torus {

// Every rank sends sendBytes[j] bytes from in + sendOffsets[j] to rank j, and receives
// recvBytes[i] bytes from rank i into out + recvOffsets[i]; all in bytes. sendBytes[j] here must
// equal recvBytes[this rank] on rank j. in and out must not overlap (an in-place alltoall needs a
// copy of in first): blocks still to be sent would be overwritten by blocks received.
void alltoallv_pairwise(Comm& comm, const void* in, const std::vector<size_t>& sendOffsets,
                        const std::vector<size_t>& sendBytes, void* out,
                        const std::vector<size_t>& recvOffsets,
                        const std::vector<size_t>& recvBytes);

} // namespace torus
