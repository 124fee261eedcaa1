#include "backend/cuda/cuda_device_path.h"

#include <chrono>
#include <string>
#include <thread>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "reduce/cuda/reduce_cuda.h"

namespace torus {

CudaDevicePath::CudaDevicePath(int device, c10::cuda::CUDAStream stream, std::chrono::milliseconds stallBound)
    : device_(device), stream_(stream), stallBound_(stallBound) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&reached_, cudaEventDisableTiming));
}

CudaDevicePath::~CudaDevicePath() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  // Nothing may still read or write the staging memory.
  cudaStreamSynchronize(stream_.stream());
  for (Pinned& pinned : staging_) {
    if (pinned.data != nullptr) {
      cudaFreeHost(pinned.data);
    }
  }
  cudaEventDestroy(reached_);
}

void CudaDevicePath::copy(void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) {
    return;
  }
  C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream_.stream()));
}

void CudaDevicePath::reduce(const DeviceReduction& op, void* dst, const void* const* srcs, int numSources,
                            size_t count) {
  if (count == 0) {
    return;
  }
  cuda::reduceSourcesOnDevice(op.dtype, op.kind, dst, srcs, numSources, count, stream_.stream());
}

void CudaDevicePath::synchronize(Deadline deadline, const DevicePhase& phase) {
  C10_CUDA_CHECK(cudaEventRecord(reached_, stream_.stream()));
  const Deadline bound = phaseDeadline(*this, deadline);
  // Spin briefly (device work of a chunk takes microseconds), then sleep in short steps so that
  // ranks sharing the host's cores keep running.
  const auto spinUntil = Clock::now() + kSpinBeforeSleep;
  for (;;) {
    const cudaError_t state = cudaEventQuery(reached_);
    if (state == cudaSuccess) {
      return;
    }
    if (state != cudaErrorNotReady) {
      C10_CUDA_CHECK(state);
    }
    const auto now = Clock::now();
    if (now >= bound) {
      const std::string where = phase.describe() + ": the work on cuda:" + std::to_string(device_) + " did not complete";
      if (bound < deadline) {
        throw CommError(CommError::Kind::kTimeout, kStalledIn + where + " within the stall bound of " +
                                                       std::to_string(stallBound_.count()) + " ms");
      }
      throw CommError(CommError::Kind::kTimeout, "timed out in " + where);
    }
    if (now < spinUntil) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

char* CudaDevicePath::staging(StagingUse use, size_t nbytes, Deadline deadline) {
  Pinned& pinned = staging_[static_cast<size_t>(use)];
  if (nbytes <= pinned.bytes) {
    return pinned.data;
  }
  if (pinned.data != nullptr) {
    synchronize(deadline, {"release of the staging buffer that grows"});
    C10_CUDA_CHECK(cudaFreeHost(pinned.data));
    pinned = Pinned{};
  }
  void* data = nullptr;
  // Mapped: the reduction kernels read received chunks straight from it.
  C10_CUDA_CHECK(cudaHostAlloc(&data, nbytes, cudaHostAllocPortable | cudaHostAllocMapped));
  void* onDevice = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&onDevice, data, 0));
  if (onDevice != data) {
    cudaFreeHost(data);
    TORCH_CHECK(false, "torus: pinned host memory is mapped at another address on cuda:", device_,
                " (no unified addressing); the staged CUDA path needs unified addressing");
  }
  pinned = Pinned{static_cast<char*>(data), nbytes};
  return pinned.data;
}

} // namespace torus
