#include "backend/cuda/cuda_ipc_arenas.h"

#include <cstring>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

namespace torus {

namespace {

static_assert(sizeof(cudaIpcMemHandle_t) <= sizeof(ArenaHandle), "an IPC handle fits an ArenaHandle");

// The text of a failed CUDA call, which is then cleared so that it is not left for torch's next
// check to find.
std::string cudaFailure(const char* call, cudaError_t error) {
  cudaGetLastError();
  return std::string(call) + ": " + cudaGetErrorString(error);
}

class CudaIpcMemory : public ArenaMemory {
 public:
  explicit CudaIpcMemory(int device) : device_(device) {}
  ~CudaIpcMemory() override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    for (char* peer : opened_) {
      cudaIpcCloseMemHandle(peer);
    }
    if (own_ != nullptr) {
      cudaFree(own_);
    }
  }

  std::string deviceName() const override {
    return "cuda:" + std::to_string(device_);
  }

  char* allocate(size_t bytes, ArenaHandle& handle, std::string& why) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    void* own = nullptr;
    if (cudaError_t error = cudaMalloc(&own, bytes); error != cudaSuccess) {
      why = cudaFailure("cudaMalloc", error);
      return nullptr;
    }
    own_ = static_cast<char*>(own);
    cudaIpcMemHandle_t ipc;
    if (cudaError_t error = cudaIpcGetMemHandle(&ipc, own); error != cudaSuccess) {
      why = cudaFailure("cudaIpcGetMemHandle", error);
      return nullptr;
    }
    std::memcpy(handle.bytes, &ipc, sizeof(ipc));
    return own_;
  }

  char* open(const ArenaHandle& handle, int rank, size_t bytes, std::string& why) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaIpcMemHandle_t ipc;
    std::memcpy(&ipc, handle.bytes, sizeof(ipc));
    void* opened = nullptr;
    if (cudaError_t error = cudaIpcOpenMemHandle(&opened, ipc, cudaIpcMemLazyEnablePeerAccess);
        error != cudaSuccess) {
      why = cudaFailure("cudaIpcOpenMemHandle", error);
      return nullptr;
    }
    opened_.push_back(static_cast<char*>(opened));
    return static_cast<char*>(opened);
  }

 private:
  const int device_;
  char* own_ = nullptr;
  std::vector<char*> opened_;
};

} // namespace

std::unique_ptr<ArenaMemory> makeCudaIpcMemory(int device) {
  return std::make_unique<CudaIpcMemory>(device);
}

} // namespace torus
