#include "collectives/partner_exchange.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <vector>

#include "collectives/blocks.h"

namespace torus {

namespace {

// Where received chunk k lands, and what happens once it has.
using Landing = std::function<void*(size_t k, const Chunk& chunk)>;
using Arrived = std::function<void(size_t k, const Chunk& chunk)>;

// Chunk k of `sent` and chunk k of `received` are posted together, at most chunksInFlight ahead
// of the chunk being completed.
void exchange(Comm& comm, int peer, void* buf, const ElementRange& sent,
              const ElementRange& received, size_t elementSize, const Chunking& chunking,
              size_t chunksInFlight, const Landing& landing, const Arrived& arrived) {
  const size_t maxElements = chunkElements(chunking, elementSize);
  std::vector<Chunk> sendChunks;
  std::vector<Chunk> receiveChunks;
  appendChunks(sendChunks, sent.offset, sent.count, maxElements);
  appendChunks(receiveChunks, received.offset, received.count, maxElements);
  const size_t rounds = std::max(sendChunks.size(), receiveChunks.size());
  const size_t window = std::min(std::max<size_t>(1, chunksInFlight), rounds);

  char* bytes = static_cast<char*>(buf);
  std::vector<RequestPtr> sends(sendChunks.size());
  std::vector<RequestPtr> receives(receiveChunks.size());
  const auto post = [&](size_t k) {
    if (k < receiveChunks.size()) {
      receives[k] = comm.irecv(peer, landing(k, receiveChunks[k]),
                               receiveChunks[k].count * elementSize);
    }
    if (k < sendChunks.size()) {
      sends[k] = comm.isend(peer, bytes + sendChunks[k].offset * elementSize,
                            sendChunks[k].count * elementSize);
    }
  };

  for (size_t k = 0; k < window; ++k) {
    post(k);
  }
  for (size_t k = 0; k < rounds; ++k) {
    // When the two ranges are the same (recursive doubling), received chunk k is sent chunk k,
    // which must not change before its send completes.
    if (k < sendChunks.size()) {
      comm.wait(sends[k]);
      sends[k].reset();
    }
    if (k < receiveChunks.size()) {
      comm.wait(receives[k]);
      receives[k].reset();
      arrived(k, receiveChunks[k]);
    }
    if (k + window < rounds) {
      post(k + window);
    }
  }
}

} // namespace

void exchangeReduce(Comm& comm, int peer, void* buf, const ElementRange& sent,
                    const ElementRange& received, const Reducer& reducer, const Chunking& chunking,
                    Scratch& scratch) {
  const size_t elementSize = reducer.elementSize;
  const size_t slotBytes =
      std::min(chunkElements(chunking, elementSize), received.count) * elementSize;
  char* staging = static_cast<char*>(scratch.get(kChunksInFlight * slotBytes));
  const auto slot = [staging, slotBytes](size_t k) {
    return staging + (k % kChunksInFlight) * slotBytes;
  };
  char* bytes = static_cast<char*>(buf);
  exchange(
      comm, peer, buf, sent, received, elementSize, chunking, kChunksInFlight,
      [&](size_t k, const Chunk&) -> void* { return slot(k); },
      [&](size_t k, const Chunk& chunk) {
        reducer(bytes + chunk.offset * elementSize, slot(k), chunk.count);
      });
}

void exchangeCopy(Comm& comm, int peer, void* buf, const ElementRange& sent,
                  const ElementRange& received, size_t elementSize, const Chunking& chunking) {
  char* bytes = static_cast<char*>(buf);
  // Chunks land in place and are final on arrival, so everything can be posted at once.
  const size_t allChunks = std::numeric_limits<size_t>::max();
  exchange(
      comm, peer, buf, sent, received, elementSize, chunking, allChunks,
      [&](size_t, const Chunk& chunk) -> void* { return bytes + chunk.offset * elementSize; },
      [](size_t, const Chunk&) {});
}

} // namespace torus
