#include "collectives/ring_pass.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace torus {

void ringPass(Comm& comm, void* buf, const Blocks& blocks, size_t elementSize,
              const Chunking& chunking, int firstSendBlock, size_t receivesInFlight,
              const ChunkLanding& landing, const ChunkArrived& arrived) {
  const int n = comm.size();
  if (blocks.offsets.size() != static_cast<size_t>(n) ||
      blocks.counts.size() != static_cast<size_t>(n)) {
    throw std::invalid_argument("ring pass over " + std::to_string(n) + " ranks given " +
                                std::to_string(blocks.counts.size()) + " blocks");
  }
  if (n == 1) {
    return;
  }
  const int next = (comm.rank() + 1) % n;
  const int prev = (comm.rank() + n - 1) % n;
  const size_t maxElements = chunkElements(chunking, elementSize);
  const auto block = [n](int b) { return static_cast<size_t>(((b % n) + n) % n); };

  std::vector<Chunk> firstSends;
  appendChunks(firstSends, blocks.offsets[block(firstSendBlock)],
               blocks.counts[block(firstSendBlock)], maxElements);
  // Every chunk this rank receives, in arrival order; those before `forwarded` are sent on.
  std::vector<Chunk> receives;
  size_t forwarded = 0;
  for (int step = 0; step < n - 1; ++step) {
    if (step == n - 2) {
      forwarded = receives.size();
    }
    const size_t b = block(firstSendBlock - step - 1);
    appendChunks(receives, blocks.offsets[b], blocks.counts[b], maxElements);
  }

  char* bytes = static_cast<char*>(buf);
  std::vector<RequestPtr> sends;
  sends.reserve(firstSends.size() + forwarded);
  const auto send = [&](const Chunk& chunk) {
    sends.push_back(
        comm.isend(next, bytes + chunk.offset * elementSize, chunk.count * elementSize));
  };
  std::vector<RequestPtr> pending(receives.size());
  const auto post = [&](size_t i) {
    pending[i] = comm.irecv(prev, landing(i, receives[i]), receives[i].count * elementSize);
  };

  // The next rank expects this rank's first block, then the chunks it forwards. The first block
  // is paced by arrivals (one more of its chunks per chunk received), so that the next rank has
  // receives posted for most of it rather than holding early chunks in transport buffers;
  // forwards wait behind it to keep that order.
  size_t firstSent = 0;
  std::vector<size_t> deferredForwards;
  const auto sendFirst = [&]() { send(firstSends[firstSent++]); };
  const size_t window = std::min(std::max<size_t>(1, receivesInFlight), receives.size());
  while (firstSent < std::min(firstSends.size(), std::max<size_t>(1, receivesInFlight))) {
    sendFirst();
  }
  for (size_t i = 0; i < window; ++i) {
    post(i);
  }
  for (size_t i = 0; i < receives.size(); ++i) {
    comm.wait(pending[i]);
    pending[i].reset();
    arrived(i, receives[i]);
    if (firstSent < firstSends.size()) {
      sendFirst();
    }
    if (i < forwarded) {
      deferredForwards.push_back(i);
    }
    if (firstSent == firstSends.size()) {
      for (size_t forward : deferredForwards) {
        send(receives[forward]);
      }
      deferredForwards.clear();
    }
    if (i + window < receives.size()) {
      post(i + window);
    }
  }
  while (firstSent < firstSends.size()) {
    sendFirst();
  }
  for (size_t forward : deferredForwards) {
    send(receives[forward]);
  }
  comm.waitAll(sends);
}

} // namespace torus
