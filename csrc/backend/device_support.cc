#include "backend/device_support.h"

#include "backend/tensor_checks.h"
#include "backend/host_device/host_device_support.h"
#ifdef TORUS_WITH_CUDA
#include "backend/cuda/cuda_device_support.h"
#endif

namespace torus {

c10::Device deviceOfCall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                         const char* collective) {
  std::optional<c10::Device> found;
  for (const auto* list : {&outputs, &inputs}) {
    for (const at::Tensor& t : *list) {
      if (!found) {
        found = t.device();
      }
      TORUS_CHECK_ARG(t.device() == *found, collective, " has tensors on ", *found, " and on ", t.device(),
                      "; a call's tensors must all be on one device");
    }
  }
  return found.value_or(c10::Device(c10::kCPU));
}

namespace {

// A build without CUDA: checkTensor has refused device tensors already.
class HostOnly : public DeviceSupport {
 public:
  std::shared_ptr<DeviceCall> begin(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                    const char* collective) override {
    deviceOfCall(outputs, inputs, collective);
    return nullptr;
  }
};

} // namespace

std::unique_ptr<DeviceSupport> DeviceSupport::create(const DeviceOptions& options) {
#ifdef TORUS_WITH_CUDA
  std::unique_ptr<DeviceSupport> devices = makeCudaDeviceSupport(options);
#else
  std::unique_ptr<DeviceSupport> devices = std::make_unique<HostOnly>();
#endif
  if (options.hostDevice != "off") {
    return makeHostDeviceSupport(options, std::move(devices));
  }
  return devices;
}

} // namespace torus
