#include "backend/host_device/host_device_support.h"

#include <atomic>
#include <stdexcept>
#include <thread>

#include "backend/device_arenas.h"
#include "backend/host_device/host_device_path.h"
#include "backend/host_device/host_shm_memory.h"

namespace torus {

namespace {

struct HostDeviceState {
  explicit HostDeviceState(const DeviceOptions& options)
      : options(options), fault(HostDeviceFault::parse(options.hostDevice)), path(false, options.stallBound, fault) {}

  const DeviceOptions options;
  const HostDeviceFault fault;
  HostDevicePath path;
  std::shared_ptr<SharedArenas> arenas;
  bool arenasSetUp = false;
};

// An event of the host device: reached once recorded, unless a stall fault holds it back.
class HostEvent {
 public:
  void record(bool stalled) {
    reached_.store(!stalled, std::memory_order_release);
  }
  bool reached() const {
    return reached_.load(std::memory_order_acquire);
  }
  // Waits for the event, yielding, until the stall bound; then throws naming `what`.
  void wait(std::chrono::milliseconds stallBound, const std::string& what) const {
    const Deadline bound = Clock::now() + stallBound;
    while (!reached()) {
      if (Clock::now() >= bound) {
        stallUntil(bound, what, stallBound);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  std::atomic<bool> reached_{false};
};

class HostCall : public DeviceCall {
 public:
  explicit HostCall(std::shared_ptr<HostDeviceState> state) : state_(std::move(state)) {
    ready_.record(state_->fault.stalls("ready"));
  }

  c10::Device device() const override {
    return c10::Device(c10::kCPU);
  }
  std::vector<c10::Device> futureDevices() const override {
    return {};
  }
  DevicePath& path() override {
    return state_->path;
  }

  std::shared_ptr<void> enter() override {
    if (state_->fault.kind == HostDeviceFault::Kind::kFail) {
      throw std::runtime_error("the host device layer failed to enter the call (TORUS_HOST_DEVICE=fail:enter)");
    }
    ready_.wait(state_->options.stallBound, "the wait for the caller's ready event");
    return nullptr;
  }
  void recordDone() override {
    done_.record(state_->fault.stalls("done"));
  }
  void attachArenas(Comm& comm) override {
    // Only the worker thread touches the arenas.
    if (!state_->arenasSetUp) {
      const DeviceOptions& options = state_->options;
      state_->arenas =
          SharedArenas::exchange(comm, state_->path, options.hosts, makeHostShmMemory(), kArenaBytes, options.logLevel);
      state_->arenasSetUp = true;
    }
    comm.attachDeviceArenas(state_->arenas);
  }

  void blockCurrentStream() override {
    done_.wait(state_->options.stallBound, "the caller's wait for the collective's done event");
  }
  bool deviceDone() override {
    return done_.reached();
  }
  bool readyReached() override {
    return ready_.reached();
  }

 private:
  std::shared_ptr<HostDeviceState> state_;
  HostEvent ready_;
  HostEvent done_;
};

class HostDeviceSupport : public DeviceSupport {
 public:
  HostDeviceSupport(const DeviceOptions& options, std::unique_ptr<DeviceSupport> other)
      : state_(std::make_shared<HostDeviceState>(options)), other_(std::move(other)) {}

  bool stagesCpuTensors() const override {
    return true;
  }

  std::shared_ptr<DeviceCall> begin(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                    const char* collective) override {
    if (!deviceOfCall(outputs, inputs, collective).is_cpu()) {
      return other_->begin(outputs, inputs, collective);
    }
    return std::make_shared<HostCall>(state_);
  }

 private:
  std::shared_ptr<HostDeviceState> state_;
  std::unique_ptr<DeviceSupport> other_;
};

} // namespace

std::unique_ptr<DeviceSupport> makeHostDeviceSupport(const DeviceOptions& options,
                                                     std::unique_ptr<DeviceSupport> other) {
  return std::make_unique<HostDeviceSupport>(options, std::move(other));
}

} // namespace torus
