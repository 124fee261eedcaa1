#include "backend/algorithm_catalog.h"

#include <c10/util/Exception.h>

namespace torus {

const std::vector<CatalogEntry>& algorithmCatalog() {
  constexpr uint64_t kAnySize = UINT64_MAX;
  static const std::vector<CatalogEntry> catalog = {
      {"allreduce", Algorithm::kRing, "ring", {}, true},
      {"allreduce", Algorithm::kTorus, "torus", {{Need::kGrid, Algorithm::kRing}}},
      {"allreduce", Algorithm::kDirect, "direct", {}, true},
      {"allreduce", Algorithm::kRecursiveDoubling, "recursive_doubling", {}, true},
      {"allreduce", Algorithm::kRabenseifner, "rabenseifner", {}, true},
      {"allreduce",
       Algorithm::kOneShot,
       "one_shot",
       {{Need::kSharedMemory, Algorithm::kRecursiveDoubling}, {Need::kFitsSlot, Algorithm::kTwoShot}}},
      {"allreduce",
       Algorithm::kTwoShot,
       "two_shot",
       {{Need::kSharedMemory, Algorithm::kRing}, {Need::kSingleCopy, Algorithm::kRing}}},
      {"allgather", Algorithm::kRing, "ring", {}, false, kAnySize},
      {"allgather", Algorithm::kDirect, "direct", {}, false, 64 * 1024},
      {"reduce_scatter", Algorithm::kRing, "ring", {}, false, kAnySize},
      {"reduce_scatter", Algorithm::kDirect, "direct", {}, false, 64 * 1024},
      {"broadcast", Algorithm::kBinomial, "binomial", {}, false, 1 << 20},
      {"broadcast", Algorithm::kChain, "chain", {}, false, kAnySize},
      {"alltoall", Algorithm::kPairwise, "pairwise", {}, false, kAnySize},
      {"reduce", Algorithm::kBinomial, "binomial", {}, false, kAnySize},
      {"gather", Algorithm::kDirect, "direct", {}, false, kAnySize},
      {"scatter", Algorithm::kDirect, "direct", {}, false, kAnySize},
      {"barrier",
       Algorithm::kSharedMemoryBarrier,
       "shared_memory",
       {{Need::kSharedMemory, Algorithm::kDissemination}},
       false,
       kAnySize},
      {"barrier", Algorithm::kDissemination, "dissemination", {}, false, kAnySize},
  };
  return catalog;
}

const char* algorithmName(Algorithm algorithm) {
  for (const auto& entry : algorithmCatalog()) {
    if (entry.algorithm == algorithm) {
      return entry.name;
    }
  }
  return "unknown";
}

const char* needName(Need need) {
  switch (need) {
    case Need::kGrid:
      return "grid";
    case Need::kSharedMemory:
      return "shared_memory";
    case Need::kSingleCopy:
      return "single_copy";
    case Need::kFitsSlot:
      return "fits_slot";
  }
  return "unknown";
}

const CatalogEntry& catalogEntry(const std::string& collective, const std::string& name) {
  for (const auto& entry : algorithmCatalog()) {
    if (entry.collective == collective && entry.name == name) {
      return entry;
    }
  }
  defaultEntry(collective);
  TORCH_CHECK_VALUE(false, "torus: ", collective, " has no algorithm named '", name, "'");
}

const CatalogEntry& catalogEntry(const std::string& collective, Algorithm algorithm) {
  for (const auto& entry : algorithmCatalog()) {
    if (entry.collective == collective && entry.algorithm == algorithm) {
      return entry;
    }
  }
  return catalogEntry(collective, std::string(algorithmName(algorithm)));
}

const CatalogEntry& defaultEntry(const std::string& collective) {
  std::string known;
  const char* last = nullptr;
  for (const auto& entry : algorithmCatalog()) {
    if (entry.collective == collective) {
      return entry;
    }
    if (last == nullptr || std::string(last) != entry.collective) {
      known += (last == nullptr ? "" : ", ") + std::string(entry.collective);
      last = entry.collective;
    }
  }
  TORCH_CHECK_VALUE(false, "torus: unknown collective '", collective, "'; known: ", known);
}

} // namespace torus
