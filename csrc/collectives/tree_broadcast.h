// The pipelined forwarding that broadcasts over a tree share, whatever the tree's shape.
#pragma once

#include <cstddef>
#include <vector>

#include "comm/comm.h"

namespace torus {

// This rank's part of a broadcast down a tree: receives buf (nbytes) from parent, unless parent is
// -1 (the root), in chunks of at most chunkBytes, straight into buf, and sends every chunk on to
// each of children, in the order given, the moment it lands. Every receive is posted at the
// start, so a rank forwards chunk k while chunk k+1 is arriving and the tree's levels overlap.
void broadcastDownTree(Comm& comm, void* buf, size_t nbytes, int parent,
                       const std::vector<int>& children, const Chunking& chunking);

} // namespace torus
