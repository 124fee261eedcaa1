#include "backend/host_staging.h"

namespace torus {

at::Tensor HostStaging::pinnedLike(const at::Tensor& tensor) {
  return at::empty(tensor.sizes(), tensor.options().device(at::kCPU).pinned_memory(!tensor.device().is_cpu()));
}

at::Tensor HostStaging::input(const at::Tensor& tensor) {
  if (!staged(tensor)) {
    return tensor;
  }
  at::Tensor host = pinnedLike(tensor);
  inputs_.emplace_back(tensor, host);
  return host;
}

at::Tensor HostStaging::output(const at::Tensor& tensor) {
  if (!staged(tensor)) {
    return tensor;
  }
  at::Tensor host = pinnedLike(tensor);
  outputs_.emplace_back(tensor, host);
  return host;
}

at::Tensor HostStaging::inputOutput(const at::Tensor& tensor) {
  if (!staged(tensor)) {
    return tensor;
  }
  at::Tensor host = pinnedLike(tensor);
  inputs_.emplace_back(tensor, host);
  outputs_.emplace_back(tensor, host);
  return host;
}

std::vector<at::Tensor> HostStaging::inputs(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> copies;
  for (const auto& t : tensors) {
    copies.push_back(input(t));
  }
  return copies;
}

std::vector<at::Tensor> HostStaging::outputs(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> copies;
  for (const auto& t : tensors) {
    copies.push_back(output(t));
  }
  return copies;
}

void HostStaging::copyIn(DeviceCall* device, Deadline deadline) {
  if (device == nullptr || inputs_.empty()) {
    return;
  }
  for (auto& [onDevice, host] : inputs_) {
    host.copy_(onDevice, /*non_blocking=*/true);
  }
  device->path().synchronize(deadline, {"host staging copies of the inputs"});
}

void HostStaging::copyOut(DeviceCall* device) {
  if (device == nullptr) {
    return;
  }
  // The pinned copies stay allocated until these copies complete: torch's host allocator records
  // them on the stream.
  for (auto& [onDevice, host] : outputs_) {
    onDevice.copy_(host, /*non_blocking=*/true);
  }
}

} // namespace torus
