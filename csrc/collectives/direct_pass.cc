#include "collectives/direct_pass.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace torus {

void directPass(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize,
                const Chunking& chunking, BlockOf sent, BlockOf received, size_t chunksInFlight,
                const PeerChunkLanding& landing, const PeerChunkArrived& arrived) {
  const int n = comm.size();
  const int self = comm.rank();
  if (blocks.offsets.size() != static_cast<size_t>(n) ||
      blocks.counts.size() != static_cast<size_t>(n)) {
    throw std::invalid_argument("direct pass over " + std::to_string(n) + " ranks given " +
                                std::to_string(blocks.counts.size()) + " blocks");
  }
  const size_t maxElements = chunkElements(chunking, elementSize);
  // Indexed by peer; this rank's own entries stay empty.
  std::vector<std::vector<Chunk>> sendChunks(n);
  std::vector<std::vector<Chunk>> receiveChunks(n);
  size_t rounds = 0;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == self) {
      continue;
    }
    const int sentBlock = sent == BlockOf::kPeer ? peer : self;
    const int receivedBlock = received == BlockOf::kPeer ? peer : self;
    appendChunks(sendChunks[peer], blocks.offsets[sentBlock], blocks.counts[sentBlock],
                 maxElements);
    appendChunks(receiveChunks[peer], blocks.offsets[receivedBlock], blocks.counts[receivedBlock],
                 maxElements);
    rounds = std::max({rounds, sendChunks[peer].size(), receiveChunks[peer].size()});
  }
  const size_t window = std::min(std::max<size_t>(1, chunksInFlight), rounds);

  char* bytes = static_cast<char*>(buf);
  std::vector<std::vector<RequestPtr>> sends(n);
  std::vector<std::vector<RequestPtr>> receives(n);
  for (int peer = 0; peer < n; ++peer) {
    sends[peer].resize(sendChunks[peer].size());
    receives[peer].resize(receiveChunks[peer].size());
  }
  const auto post = [&](size_t k) {
    for (int d = 1; d < n; ++d) {
      const int from = (self - d + n) % n;
      const int to = (self + d) % n;
      if (k < receiveChunks[from].size()) {
        const Chunk& chunk = receiveChunks[from][k];
        receives[from][k] = comm.irecv(from, landing(from, k, chunk), chunk.count * elementSize);
      }
      if (k < sendChunks[to].size()) {
        const Chunk& chunk = sendChunks[to][k];
        sends[to][k] =
            comm.isend(to, bytes + chunk.offset * elementSize, chunk.count * elementSize);
      }
    }
  };

  for (size_t k = 0; k < window; ++k) {
    post(k);
  }
  for (size_t k = 0; k < rounds; ++k) {
    for (int d = 1; d < n; ++d) {
      const int from = (self - d + n) % n;
      const int to = (self + d) % n;
      if (k < receives[from].size()) {
        comm.wait(receives[from][k]);
        receives[from][k].reset();
        arrived(from, k, receiveChunks[from][k]);
      }
      if (k < sends[to].size()) {
        comm.wait(sends[to][k]);
        sends[to][k].reset();
      }
    }
    if (k + window < rounds) {
      post(k + window);
    }
  }
}

} // namespace torus
