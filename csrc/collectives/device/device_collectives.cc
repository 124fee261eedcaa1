#include "collectives/device/device_collectives.h"

#include "collectives/device/arena_allgather.h"
#include "collectives/device/arena_reduce_scatter.h"
#include "collectives/device/staged_ring_allgather.h"
#include "collectives/device/staged_ring_reduce_scatter.h"

namespace torus {

DeviceRoute deviceRouteFor(const Comm& comm) {
  return comm.deviceArenas() ? DeviceRoute::kArenas : DeviceRoute::kStaged;
}

const char* deviceRouteName(DeviceRoute route) {
  return route == DeviceRoute::kArenas ? "cuda_ipc" : "staged";
}

std::string describeRoutes(const DeviceRoutes& routes) {
  if (!routes.columns) {
    return deviceRouteName(routes.rows);
  }
  return std::string("torus (rows ") + deviceRouteName(routes.rows) + ", columns " +
         deviceRouteName(*routes.columns) + ")";
}

DeviceRoute device_reduce_scatter(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf,
                                  const Blocks& blocks, const Chunking& chunking) {
  const DeviceRoute route = deviceRouteFor(comm);
  if (comm.size() == 1) {
    return route;
  }
  if (route == DeviceRoute::kArenas) {
    arena_reduce_scatter(comm, path, op, buf, blocks);
  } else {
    staged_ring_reduce_scatter(comm, path, op, buf, blocks, chunking);
  }
  return route;
}

DeviceRoute device_allgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize,
                             const Chunking& chunking) {
  const DeviceRoute route = deviceRouteFor(comm);
  if (comm.size() == 1) {
    return route;
  }
  if (route == DeviceRoute::kArenas) {
    arena_allgather(comm, path, buf, blocks, elementSize);
  } else {
    staged_ring_allgather(comm, path, buf, blocks, elementSize, chunking, false);
  }
  return route;
}

namespace {

DeviceRoute flatAllreduce(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, size_t count,
                          const Chunking& chunking) {
  const DeviceRoute route = deviceRouteFor(comm);
  if (comm.size() == 1) {
    return route;
  }
  const Blocks blocks = evenBlocks(count, comm.size());
  const size_t elementSize = torus::elementSize(op.dtype);
  if (route == DeviceRoute::kArenas) {
    arena_reduce_scatter(comm, path, op, buf, blocks);
    arena_allgather(comm, path, buf, blocks, elementSize);
  } else {
    // The reduce-scatter leaves this rank's block in the mirror the allgather sends from.
    staged_ring_reduce_scatter(comm, path, op, buf, blocks, chunking);
    staged_ring_allgather(comm, path, buf, blocks, elementSize, chunking, true);
  }
  return route;
}

} // namespace

DeviceRoutes device_allreduce(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, size_t count,
                              const TorusGrid* grid, const Chunking& chunking) {
  if (grid == nullptr || grid->rows.size() <= 1 || grid->rows.front().size() <= 1) {
    return DeviceRoutes{flatAllreduce(comm, path, op, buf, count, chunking), std::nullopt};
  }
  const GridLines lines = linesThrough(*grid, comm.size(), comm.rank());
  Comm row = comm.subset(lines.row);
  Comm column = comm.subset(lines.column);
  const Blocks blocks = evenBlocks(count, row.size());
  const size_t elementSize = torus::elementSize(op.dtype);
  const DeviceRoute rows = device_reduce_scatter(row, path, op, buf, blocks, chunking);
  const DeviceRoute columns =
      flatAllreduce(column, path, op, static_cast<char*>(buf) + blocks.offsets[row.rank()] * elementSize,
                    blocks.counts[row.rank()], chunking);
  device_allgather(row, path, buf, blocks, elementSize, chunking);
  return DeviceRoutes{rows, columns};
}

} // namespace torus
