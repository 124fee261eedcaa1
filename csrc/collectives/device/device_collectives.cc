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

void device_reduce_scatter(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, const Blocks& blocks,
                           const Chunking& chunking) {
  if (comm.size() == 1) {
    return;
  }
  if (deviceRouteFor(comm) == DeviceRoute::kArenas) {
    arena_reduce_scatter(comm, path, op, buf, blocks);
  } else {
    staged_ring_reduce_scatter(comm, path, op, buf, blocks, chunking);
  }
}

void device_allgather(Comm& comm, DevicePath& path, void* buf, const Blocks& blocks, size_t elementSize,
                      const Chunking& chunking) {
  if (comm.size() == 1) {
    return;
  }
  if (deviceRouteFor(comm) == DeviceRoute::kArenas) {
    arena_allgather(comm, path, buf, blocks, elementSize);
  } else {
    staged_ring_allgather(comm, path, buf, blocks, elementSize, chunking, false);
  }
}

namespace {

void flatAllreduce(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, size_t count,
                   const Chunking& chunking) {
  if (comm.size() == 1) {
    return;
  }
  const Blocks blocks = evenBlocks(count, comm.size());
  const size_t elementSize = torus::elementSize(op.dtype);
  if (deviceRouteFor(comm) == DeviceRoute::kArenas) {
    arena_reduce_scatter(comm, path, op, buf, blocks);
    arena_allgather(comm, path, buf, blocks, elementSize);
  } else {
    // The reduce-scatter leaves this rank's block in the mirror the allgather sends from.
    staged_ring_reduce_scatter(comm, path, op, buf, blocks, chunking);
    staged_ring_allgather(comm, path, buf, blocks, elementSize, chunking, true);
  }
}

} // namespace

void device_allreduce(Comm& comm, DevicePath& path, const DeviceReduction& op, void* buf, size_t count,
                      const TorusGrid* grid, const Chunking& chunking) {
  if (grid == nullptr || grid->rows.size() <= 1 || grid->rows.front().size() <= 1) {
    flatAllreduce(comm, path, op, buf, count, chunking);
    return;
  }
  const GridLines lines = linesThrough(*grid, comm.size(), comm.rank());
  Comm row = comm.subset(lines.row);
  Comm column = comm.subset(lines.column);
  const Blocks blocks = evenBlocks(count, row.size());
  const size_t elementSize = torus::elementSize(op.dtype);
  device_reduce_scatter(row, path, op, buf, blocks, chunking);
  flatAllreduce(column, path, op, static_cast<char*>(buf) + blocks.offsets[row.rank()] * elementSize,
                blocks.counts[row.rank()], chunking);
  device_allgather(row, path, buf, blocks, elementSize, chunking);
}

} // namespace torus
