// AlgorithmDispatch: which algorithm a group runs each call with, and running it. It holds the
// group's selection rules (TORUS_<COLLECTIVE> merged with the automatic choice), what the group
// offers the algorithms (a torus grid, shared memory), and the algorithms' working memory.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/algorithm_catalog.h"
#include "backend/torus_config.h"
#include "collectives/allreduce.h"
#include "collectives/blocks.h"
#include "collectives/device/device_collectives.h"
#include "comm/comm.h"
#include "comm/device_path.h"
#include "reduce/reduce.h"

namespace torus {

class AlgorithmDispatch {
 public:
  // Raises c10::ValueError naming the setting when the configuration does not fit a group of
  // `size` ranks (an unknown algorithm, a reversed rule, a grid of another size).
  AlgorithmDispatch(const TorusConfig& config, int size);

  // What the group's Comm offers the shared-memory algorithms.
  void setSharedMemory(bool available, bool singleCopy);

  // The algorithm for a call of `nbytes` bytes (the size of the largest buffer of the call:
  // allreduce and broadcast its tensor, allgather its output, reduce_scatter its input — as
  // nccl-tests count), after usable().
  Algorithm algorithmFor(const std::string& collective, uint64_t nbytes) const;
  // `entry`'s algorithm, or what the catalog runs in its place where this group lacks one of its
  // needs.
  Algorithm usable(const CatalogEntry& entry, uint64_t nbytes) const;
  // The rules whose algorithm this group runs another in place of, for want of what the group
  // lacks (a grid, shared memory, single copies), for the startup log: "barrier shared_memory
  // runs as dissemination (no shared_memory)"; empty when there are none.
  std::string standIns() const;

  void allreduce(Algorithm algorithm, Comm& comm, void* buf, size_t count, const Reducer& reducer);
  void allgather(Algorithm algorithm, Comm& comm, void* buf, const Blocks& blocks, size_t elementSize);
  void reduceScatter(Algorithm algorithm, Comm& comm, void* buf, const Blocks& blocks, const Reducer& reducer);
  void broadcast(Algorithm algorithm, Comm& comm, void* buf, size_t nbytes, int root);
  void reduce(Comm& comm, void* buf, size_t count, const Reducer& reducer, int root);
  void barrier(Algorithm algorithm, Comm& comm);

  // The device forms (collectives/device/), on device memory through `path`: each runs by its
  // Comm's device route (arenas on one host, else staged through pinned host memory). Allreduce
  // keeps the torus grid when `algorithm` is torus; every other host algorithm maps to the flat
  // device form. Each returns the routes it took, for the debug log.
  DeviceRoutes deviceAllreduce(Algorithm algorithm, Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf,
                       size_t count);
  DeviceRoutes deviceAllgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize);
  DeviceRoutes deviceReduceScatter(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, const Blocks& blocks);

 private:
  bool has(Need need, uint64_t nbytes) const;

  struct SelectionRule {
    uint64_t lo;
    uint64_t hi;
    const CatalogEntry* entry;
  };
  // Per collective of the catalog, resolved once so that a call costs one lookup: its rules,
  // and what runs where none covers the size.
  struct Selection {
    std::vector<SelectionRule> rules;
    Algorithm fallback;
  };
  std::map<std::string, Selection> selection_;
  TorusGrid grid_;
  AllreduceFn torusInner_ = nullptr;
  bool sharedMemory_ = false;
  bool singleCopy_ = false;
  Chunking chunking_;
  Scratch scratch_;
};

} // namespace torus
