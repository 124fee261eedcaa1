// The collectives on device memory, each by the route its Comm allows: through device arenas
// when every rank of the Comm has one mapped here (ranks of one host), else staged through pinned
// host memory over the transport. Allreduce on a torus grid runs its three phases on the rows
// and columns, each by its own route: rows on one host through arenas, columns across hosts
// staged.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "collectives/blocks.h"
#include "collectives/torus_allreduce.h"
#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

enum class DeviceRoute : uint8_t {
  kArenas, // arena_reduce_scatter, arena_allgather
  kStaged, // staged_ring_reduce_scatter, staged_ring_allgather
};

// The route comm's collectives take; the same on every rank of comm.
DeviceRoute deviceRouteFor(const Comm& comm);
// "cuda_ipc", "staged": what the debug log names.
const char* deviceRouteName(DeviceRoute route);

// The routes a device allreduce took: `flat` for the whole Comm, or with a grid its rows' and
// its columns' routes.
struct DeviceRoutes {
  DeviceRoute rows;
  std::optional<DeviceRoute> columns;
};
// "staged", "torus (rows cuda_ipc, columns staged)".
std::string describeRoutes(const DeviceRoutes& routes);

// In place: block comm.rank() of buf ends reduced over all ranks; other blocks unspecified.
DeviceRoute device_reduce_scatter(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, const Blocks& blocks,
                           const Chunking& chunking);
// Every rank's block comm.rank() of buf ends in every rank's buf.
DeviceRoute device_allgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize,
                      const Chunking& chunking);
// In place: buf (count elements) ends holding the reduction over all ranks of comm: a
// reduce-scatter over even blocks, then an allgather, by comm's route; with a grid (nullptr:
// none), reduce-scatter along this rank's row, allreduce of its row block along its column,
// allgather along the row. Returns the routes it took.
DeviceRoutes device_allreduce(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, size_t count,
                      const TorusGrid* grid, const Chunking& chunking);

} // namespace torus
