#include "collectives/tree_broadcast.h"

#include "collectives/blocks.h"

namespace torus {

void broadcastDownTree(Comm& comm, void* buf, size_t nbytes, int parent,
                       const std::vector<int>& children, const Chunking& chunking) {
  std::vector<Chunk> chunks;
  appendChunks(chunks, 0, nbytes, chunkElements(chunking, 1));
  char* bytes = static_cast<char*>(buf);

  std::vector<RequestPtr> receives;
  if (parent >= 0) {
    receives.reserve(chunks.size());
    for (const Chunk& chunk : chunks) {
      receives.push_back(comm.irecv(parent, bytes + chunk.offset, chunk.count));
    }
  }
  std::vector<RequestPtr> sends;
  sends.reserve(chunks.size() * children.size());
  for (size_t k = 0; k < chunks.size(); ++k) {
    if (parent >= 0) {
      comm.wait(receives[k]);
    }
    for (int child : children) {
      sends.push_back(comm.isend(child, bytes + chunks[k].offset, chunks[k].count));
    }
  }
  comm.waitAll(sends);
}

} // namespace torus
