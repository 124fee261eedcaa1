// CudaDevicePath: DevicePath on one CUDA device and stream: copies by cudaMemcpyAsync, reductions
// by the kernels of reduce/cuda/, waits by polling an event (spin briefly, then sleep, bounded by
// the collective's deadline and the stall bound), staging in pinned, mapped host memory.
#pragma once

#include <array>

#include <c10/cuda/CUDAStream.h>

#include "comm/device_path.h"

namespace torus {

class CudaDevicePath : public DevicePath {
 public:
  CudaDevicePath(int device, c10::cuda::CUDAStream stream, std::chrono::milliseconds stallBound);
  ~CudaDevicePath() override;
  CudaDevicePath(const CudaDevicePath&) = delete;
  CudaDevicePath& operator=(const CudaDevicePath&) = delete;

  void copy(void* dst, const void* src, size_t nbytes) override;
  void reduce(const DeviceReduction& op, void* dst, const void* const* srcs, int numSources, size_t count) override;
  void synchronize(Deadline deadline, const DevicePhase& phase) override;
  std::chrono::milliseconds stallBound() const override {
    return stallBound_;
  }
  char* staging(StagingUse use, size_t nbytes, Deadline deadline) override;

 private:
  struct Pinned {
    char* data = nullptr;
    size_t bytes = 0;
  };
  const int device_;
  const c10::cuda::CUDAStream stream_;
  const std::chrono::milliseconds stallBound_;
  cudaEvent_t reached_ = nullptr;
  std::array<Pinned, 2> staging_{};
};

} // namespace torus
