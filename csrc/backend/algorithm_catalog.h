// The algorithm catalog: every algorithm of every collective, declared once. Each entry says
// which collective it serves, what it needs to run (a torus grid, the ranks' shared memory,
// single-copy access, a message that fits a shared-memory slot) and, for each need, what runs
// instead where the group lacks it — as oneCCL's selector holds names, can-use checks and
// fallbacks in one table. torch_torus._C exports it; the Python configuration, selection, cost
// model, tuner and bench derive their lists from it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torus {

// The values travel in CallSignature (as value + 1): append, never renumber.
enum class Algorithm : uint8_t {
  kRing,
  kTorus,
  kDirect,
  kRecursiveDoubling,
  kRabenseifner,
  kOneShot,
  kTwoShot,
  kBinomial,
  kChain,
  kPairwise,
  kDissemination,
  kSharedMemoryBarrier,
};

// What an algorithm may need of the group it runs in.
enum class Need : uint8_t {
  kGrid,         // a torus grid (a world size that factors)
  kSharedMemory, // every rank of the group in one host's shared memory
  kSingleCopy,   // shared memory with single-copy access between the ranks' buffers
  kFitsSlot,     // a message no larger than one shared-memory slot
};

struct Requirement {
  Need need;
  Algorithm instead; // what runs where the group lacks this need (itself checked in turn)
};

struct CatalogEntry {
  const char* collective; // "allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", ...
  Algorithm algorithm;
  const char* name;
  std::vector<Requirement> needs;
  // May run a torus column (the torus's inner allreduce).
  bool torusInner = false;
  // For collectives chosen by size without a cost model: the automatic choice for calls larger
  // than the collective's next smaller threshold, up to this many bytes. 0 for allreduce, which
  // the cost model chooses.
  uint64_t autoUpToBytes = 0;
};

// Every entry; a collective's first entry is what it runs when no rule covers a call.
const std::vector<CatalogEntry>& algorithmCatalog();

const char* algorithmName(Algorithm algorithm);
const char* needName(Need need);

// The entry for `name` serving `collective`; throws c10::ValueError naming both when none.
const CatalogEntry& catalogEntry(const std::string& collective, const std::string& name);
// The entry of `algorithm` serving `collective`.
const CatalogEntry& catalogEntry(const std::string& collective, Algorithm algorithm);
// The collective's first entry; throws c10::ValueError naming the known collectives when none.
const CatalogEntry& defaultEntry(const std::string& collective);

} // namespace torus
