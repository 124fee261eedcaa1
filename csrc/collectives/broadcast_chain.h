#pragma once

#include <cstddef>

#include "comm/comm.h"

namespace torus {

// buf (nbytes) on root is copied into buf on every rank.
void broadcast_chain(Comm& comm, void* buf, size_t nbytes, int root, const Chunking& chunking);

} // namespace torus
