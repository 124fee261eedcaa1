#include "backend/cuda/cuda_device_support.h"

#include <map>
#include <mutex>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "backend/cuda/cuda_device_path.h"
#include "backend/cuda/cuda_ipc_arenas.h"

namespace torus {

namespace {

// An event of one device, created at its first record (ATen's CUDAEvent would pull in the CUDA
// math libraries' headers, which a bare toolkit lacks).
class CudaEvent {
 public:
  CudaEvent() = default;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() {
    if (event_ != nullptr) {
      c10::cuda::CUDAGuard guard(device_);
      cudaEventDestroy(event_);
    }
  }

  void record(const c10::cuda::CUDAStream& stream) {
    if (event_ == nullptr) {
      device_ = stream.device_index();
      c10::cuda::CUDAGuard guard(device_);
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    }
    C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream()));
  }
  // `stream` waits for the last record; nothing to wait for before the first.
  void block(const c10::cuda::CUDAStream& stream) const {
    if (event_ != nullptr) {
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), event_, 0));
    }
  }
  bool query() const {
    if (event_ == nullptr) {
      return true;
    }
    const cudaError_t state = cudaEventQuery(event_);
    if (state == cudaErrorNotReady) {
      return false;
    }
    C10_CUDA_CHECK(state);
    return true;
  }

 private:
  cudaEvent_t event_ = nullptr;
  c10::DeviceIndex device_ = 0;
};

// One device of one group.
struct CudaDeviceState {
  CudaDeviceState(int index, const DeviceOptions& options)
      : device(index),
        stream(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(index))),
        path(index, stream, options.stallBound),
        options(options) {}

  const int device;
  const c10::cuda::CUDAStream stream;
  CudaDevicePath path;
  const DeviceOptions options;
  // Set up at the group's first call on this device that can use them; ranks that could not map
  // their host peers' arenas have none, and their calls take the staged route.
  std::shared_ptr<SharedArenas> arenas;
  bool arenasSetUp = false;
};

class CudaCall : public DeviceCall {
 public:
  CudaCall(std::shared_ptr<CudaDeviceState> state, std::unique_ptr<CudaEvent> ready)
      : state_(std::move(state)), ready_(std::move(ready)) {}

  c10::Device device() const override {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(state_->device));
  }
  std::vector<c10::Device> futureDevices() const override {
    return {device()};
  }
  DevicePath& path() override {
    return state_->path;
  }

  std::shared_ptr<void> enter() override {
    auto scope = std::make_shared<c10::cuda::CUDAStreamGuard>(state_->stream);
    ready_->block(state_->stream);
    return scope;
  }
  void recordDone() override {
    done_.record(state_->stream);
  }
  void attachArenas(Comm& comm) override {
    // Only the worker thread touches the arenas.
    if (!state_->arenasSetUp) {
      const DeviceOptions& options = state_->options;
      state_->arenas = SharedArenas::exchange(comm, state_->path, options.hosts, makeCudaIpcMemory(state_->device),
                                              kArenaBytes, options.logLevel);
      state_->arenasSetUp = true;
    }
    comm.attachDeviceArenas(state_->arenas);
  }

  void blockCurrentStream() override {
    done_.block(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(state_->device)));
  }
  bool deviceDone() override {
    return done_.query();
  }
  bool readyReached() override {
    return ready_->query();
  }

 private:
  std::shared_ptr<CudaDeviceState> state_;
  std::unique_ptr<CudaEvent> ready_;
  CudaEvent done_;
};

class CudaDeviceSupport : public DeviceSupport {
 public:
  explicit CudaDeviceSupport(DeviceOptions options) : options_(std::move(options)) {}

  std::shared_ptr<DeviceCall> begin(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                    const char* collective) override {
    const c10::Device device = deviceOfCall(outputs, inputs, collective);
    if (device.is_cpu()) {
      return nullptr;
    }
    std::shared_ptr<CudaDeviceState> state = stateOf(device.index());
    c10::cuda::CUDAGuard guard(device.index());
    auto ready = std::make_unique<CudaEvent>();
    ready->record(c10::cuda::getCurrentCUDAStream(device.index()));
    for (const auto* list : {&outputs, &inputs}) {
      for (const at::Tensor& t : *list) {
        if (t.storage().data_ptr().get() != nullptr) {
          c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), state->stream);
        }
      }
    }
    return std::make_shared<CudaCall>(std::move(state), std::move(ready));
  }

 private:
  std::shared_ptr<CudaDeviceState> stateOf(c10::DeviceIndex index) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& state = states_[index];
    if (!state) {
      state = std::make_shared<CudaDeviceState>(index, options_);
    }
    return state;
  }

  const DeviceOptions options_;
  std::mutex mutex_;
  std::map<int, std::shared_ptr<CudaDeviceState>> states_;
};

} // namespace

std::unique_ptr<DeviceSupport> makeCudaDeviceSupport(const DeviceOptions& options) {
  return std::make_unique<CudaDeviceSupport>(options);
}

} // namespace torus
