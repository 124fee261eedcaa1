#include "backend/cuda/cuda_ipc_arenas.h"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "collectives/blocks.h"
#include "collectives/ring_allgather.h"

namespace torus {

namespace {

// What each rank tells the group about its arena: fixed size, so that the allgather's blocks
// are equal.
struct ArenaRecord {
  char host[96]; // host name and boot id: ranks that can share device memory
  cudaIpcMemHandle_t handle;
  int32_t allocated;
  int32_t pid;
};

std::string hostIdentity() {
  char name[64] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(name) + "/" + boot;
}

template <typename T>
std::vector<T> allgatherRecords(Comm& group, const T& mine) {
  std::vector<T> all(static_cast<size_t>(group.size()));
  all[static_cast<size_t>(group.rank())] = mine;
  ring_allgather(group, all.data(), evenBlocks(all.size() * sizeof(T), group.size()), 1, Chunking{});
  return all;
}

} // namespace

CudaIpcArenas::CudaIpcArenas(int device, size_t bytes, int size)
    : device_(device), bytes_(bytes), arenas_(static_cast<size_t>(size), nullptr) {}

CudaIpcArenas::~CudaIpcArenas() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  for (char* peer : opened_) {
    cudaIpcCloseMemHandle(peer);
  }
  if (own_ != nullptr) {
    cudaFree(own_);
  }
}

char* CudaIpcArenas::arena(int transportRank) const {
  return arenas_.at(static_cast<size_t>(transportRank));
}

std::shared_ptr<CudaIpcArenas> CudaIpcArenas::exchange(Comm& group, int device, size_t bytes) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  std::shared_ptr<CudaIpcArenas> arenas(new CudaIpcArenas(device, bytes, group.size()));
  const int self = group.rank();

  ArenaRecord mine{};
  std::strncpy(mine.host, hostIdentity().c_str(), sizeof(mine.host) - 1);
  mine.pid = static_cast<int32_t>(getpid());
  void* own = nullptr;
  if (cudaMalloc(&own, bytes) == cudaSuccess) {
    arenas->own_ = static_cast<char*>(own);
    mine.allocated = cudaIpcGetMemHandle(&mine.handle, own) == cudaSuccess;
  }
  cudaGetLastError(); // a failure above is answered by `allocated`, not left for the next call
  const std::vector<ArenaRecord> records = allgatherRecords(group, mine);

  // This rank's arena counts only if it mapped every host peer's.
  std::vector<char*> mapped(static_cast<size_t>(group.size()), nullptr);
  int8_t complete = mine.allocated;
  for (int r = 0; r < group.size() && complete; ++r) {
    const ArenaRecord& peer = records[static_cast<size_t>(r)];
    if (r == self || std::strncmp(peer.host, mine.host, sizeof(mine.host)) != 0) {
      continue;
    }
    void* opened = nullptr;
    if (!peer.allocated || peer.pid == mine.pid ||
        cudaIpcOpenMemHandle(&opened, peer.handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      cudaGetLastError();
      complete = 0;
      break;
    }
    mapped[static_cast<size_t>(r)] = static_cast<char*>(opened);
    arenas->opened_.push_back(static_cast<char*>(opened));
  }
  const std::vector<int8_t> completes = allgatherRecords(group, complete);
  for (int r = 0; r < group.size(); ++r) {
    const bool sameHost = std::strncmp(records[static_cast<size_t>(r)].host, mine.host, sizeof(mine.host)) == 0;
    if (complete && completes[static_cast<size_t>(r)] && sameHost) {
      arenas->arenas_[static_cast<size_t>(r)] = r == self ? arenas->own_ : mapped[static_cast<size_t>(r)];
    }
  }
  return arenas;
}

} // namespace torus
