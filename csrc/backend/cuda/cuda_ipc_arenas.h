// CudaIpcArenas: DeviceArenas by CUDA IPC. Each rank cudaMallocs one arena (IPC handles name
// whole allocations, not the caching allocator's sub-blocks), the group allgathers the handles
// with each rank's host identity and GPU, and each rank opens those of the ranks on its host
// (cudaIpcOpenMemHandle, peer access enabled lazily). Ranks sharing one GPU work too: they are
// different processes, and IPC is refused only within one process. A second allgather tells
// every rank which ranks opened all of their host peers' arenas; only those count as mapped, so
// every rank agrees on which Comms have arenas.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

class CudaIpcArenas : public DeviceArenas {
 public:
  // Collective over `group` (the whole group, comm rank = transport rank): sets up this rank's
  // arena of `bytes` on `device` and maps its host peers'. Device failures (no memory, no peer
  // access) leave ranks unmapped rather than failing; transport failures raise.
  static std::shared_ptr<CudaIpcArenas> exchange(Comm& group, int device, size_t bytes);
  ~CudaIpcArenas() override;
  CudaIpcArenas(const CudaIpcArenas&) = delete;
  CudaIpcArenas& operator=(const CudaIpcArenas&) = delete;

  size_t bytes() const override {
    return bytes_;
  }
  char* arena(int transportRank) const override;

 private:
  CudaIpcArenas(int device, size_t bytes, int size);

  const int device_;
  const size_t bytes_;
  char* own_ = nullptr;
  // By transport rank: mapped here (own_ for this rank), or nullptr.
  std::vector<char*> arenas_;
  std::vector<char*> opened_;
};

} // namespace torus
