#include "backend/algorithm_dispatch.h"

#include "backend/tensor_checks.h"
#include "collectives/barrier_dissemination.h"
#include "collectives/barrier_shared_memory.h"
#include "collectives/broadcast_binomial.h"
#include "collectives/broadcast_chain.h"
#include "collectives/direct_allgather.h"
#include "collectives/direct_reduce_scatter.h"
#include "collectives/reduce_binomial.h"
#include "collectives/ring_allgather.h"
#include "collectives/ring_reduce_scatter.h"
#include "transport/shared_memory.h"

namespace torus {

namespace {

AllreduceFn allreduceFunction(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kDirect:
      return direct_allreduce;
    case Algorithm::kRecursiveDoubling:
      return recursive_doubling_allreduce;
    case Algorithm::kRabenseifner:
      return rabenseifner_allreduce;
    case Algorithm::kOneShot:
      return one_shot_allreduce;
    case Algorithm::kTwoShot:
      return two_shot_allreduce;
    default:
      return ring_allreduce;
  }
}

std::string torusInnerNames() {
  std::string names;
  for (const auto& entry : algorithmCatalog()) {
    if (entry.torusInner) {
      names += (names.empty() ? "" : ", ") + std::string(entry.name);
    }
  }
  return names;
}

} // namespace

AlgorithmDispatch::AlgorithmDispatch(const TorusConfig& config, int size) {
  TORUS_CHECK_ARG(config.chunkBytes > 0, "chunk size must be positive, got ", config.chunkBytes);
  chunking_.chunkBytes = static_cast<size_t>(config.chunkBytes);
  for (const auto& entry : algorithmCatalog()) {
    selection_.emplace(entry.collective, Selection{{}, defaultEntry(entry.collective).algorithm});
  }
  for (const auto& [collective, rules] : config.algorithms) {
    Selection& selection = selection_.at(defaultEntry(collective).collective);
    for (const auto& rule : rules) {
      TORUS_CHECK_ARG(rule.lo <= rule.hi, collective, " rule ", rule.algorithm, ":", rule.lo, "-", rule.hi,
                      " is reversed");
      selection.rules.push_back({rule.lo, rule.hi, &catalogEntry(collective, rule.algorithm)});
    }
  }
  if (!config.torusRows.empty()) {
    size_t members = 0;
    for (const auto& row : config.torusRows) {
      TORUS_CHECK_ARG(row.size() == config.torusRows[0].size(), "torus grid rows differ in length");
      members += row.size();
    }
    TORUS_CHECK_ARG(members == static_cast<size_t>(size), "torus grid has ", members, " ranks, the group ", size);
    grid_.rows = config.torusRows;
  }
  const CatalogEntry& inner = catalogEntry("allreduce", config.torusInner);
  TORUS_CHECK_ARG(inner.torusInner, "the torus inner algorithm ", config.torusInner,
                  " cannot run on a torus column (one that can: ", torusInnerNames(), ")");
  torusInner_ = allreduceFunction(inner.algorithm);
}

void AlgorithmDispatch::setSharedMemory(bool available, bool singleCopy) {
  sharedMemory_ = available;
  singleCopy_ = available && singleCopy;
}

Algorithm AlgorithmDispatch::algorithmFor(const std::string& collective, uint64_t nbytes) const {
  auto selection = selection_.find(collective);
  if (selection == selection_.end()) {
    return defaultEntry(collective).algorithm; // raises naming the known collectives
  }
  for (const auto& rule : selection->second.rules) {
    if (nbytes >= rule.lo && nbytes <= rule.hi) {
      return usable(*rule.entry, nbytes);
    }
  }
  return selection->second.fallback;
}

Algorithm AlgorithmDispatch::usable(const CatalogEntry& entry, uint64_t nbytes) const {
  for (const Requirement& requirement : entry.needs) {
    if (!has(requirement.need, nbytes)) {
      return usable(catalogEntry(entry.collective, requirement.instead), nbytes);
    }
  }
  return entry.algorithm;
}

std::string AlgorithmDispatch::standIns() const {
  std::string text;
  for (const auto& [collective, selection] : selection_) {
    for (const auto& rule : selection.rules) {
      for (const Requirement& requirement : rule.entry->needs) {
        // A message's size decides kFitsSlot call by call, as the catalog table says.
        if (requirement.need != Need::kFitsSlot && !has(requirement.need, rule.lo)) {
          text += (text.empty() ? "" : "; ") + collective + " " + algorithmName(rule.entry->algorithm) + " runs as " +
                  algorithmName(usable(*rule.entry, rule.lo)) + " (no " + needName(requirement.need) + ")";
          break;
        }
      }
    }
  }
  return text;
}

bool AlgorithmDispatch::has(Need need, uint64_t nbytes) const {
  switch (need) {
    case Need::kGrid:
      return !grid_.rows.empty();
    case Need::kSharedMemory:
      return sharedMemory_;
    case Need::kSingleCopy:
      return singleCopy_;
    case Need::kFitsSlot:
      return nbytes <= SharedMemory::kSlotBytes;
  }
  return false;
}

void AlgorithmDispatch::allreduce(Algorithm algorithm, Comm& comm, void* buf, size_t count, const Reducer& reducer) {
  if (algorithm == Algorithm::kTorus) {
    torus_allreduce(comm, buf, count, reducer, grid_, torusInner_, chunking_, scratch_);
  } else {
    allreduceFunction(algorithm)(comm, buf, count, reducer, chunking_, scratch_);
  }
}

void AlgorithmDispatch::allgather(Algorithm algorithm, Comm& comm, void* buf, const Blocks& blocks,
                                  size_t elementSize) {
  if (algorithm == Algorithm::kDirect) {
    direct_allgather(comm, buf, blocks, elementSize, chunking_);
  } else {
    ring_allgather(comm, buf, blocks, elementSize, chunking_);
  }
}

void AlgorithmDispatch::reduceScatter(Algorithm algorithm, Comm& comm, void* buf, const Blocks& blocks,
                                      const Reducer& reducer) {
  if (algorithm == Algorithm::kDirect) {
    direct_reduce_scatter(comm, buf, blocks, reducer, chunking_, scratch_);
  } else {
    ring_reduce_scatter(comm, buf, blocks, reducer, chunking_, scratch_);
  }
}

void AlgorithmDispatch::broadcast(Algorithm algorithm, Comm& comm, void* buf, size_t nbytes, int root) {
  if (algorithm == Algorithm::kChain) {
    broadcast_chain(comm, buf, nbytes, root, chunking_);
  } else {
    broadcast_binomial(comm, buf, nbytes, root, chunking_);
  }
}

void AlgorithmDispatch::barrier(Algorithm algorithm, Comm& comm) {
  if (algorithm == Algorithm::kSharedMemoryBarrier) {
    barrier_shared_memory(comm);
  } else {
    barrier_dissemination(comm);
  }
}

void AlgorithmDispatch::reduce(Comm& comm, void* buf, size_t count, const Reducer& reducer, int root) {
  reduce_binomial(comm, buf, count, reducer, root, chunking_, scratch_);
}

DeviceRoutes AlgorithmDispatch::deviceAllreduce(Algorithm algorithm, Comm& comm, DevicePath& path,
                                                const DeviceReduction& op, void* buf, size_t count) {
  return device_allreduce(comm, path, op, buf, count, algorithm == Algorithm::kTorus ? &grid_ : nullptr, chunking_);
}

DeviceRoutes AlgorithmDispatch::deviceAllgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks,
                                                size_t elementSize) {
  return DeviceRoutes{device_allgather(comm, path, buf, blocks, elementSize, chunking_), std::nullopt};
}

DeviceRoutes AlgorithmDispatch::deviceReduceScatter(Comm& comm, DevicePath& path, const DeviceReduction& op,
                                                    void* buf, const Blocks& blocks) {
  return DeviceRoutes{device_reduce_scatter(comm, path, op, buf, blocks, chunking_), std::nullopt};
}

} // namespace torus
