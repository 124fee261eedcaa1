// Host copies of a call's device tensors, for the collectives that move bytes without computing
// on them (gather, scatter, broadcast, all_to_all, coalesced all_gather): the entry point swaps
// each device tensor for a pinned host tensor of its shape, the job copies the inputs down
// before it runs the host algorithm and the outputs up after, all on the call's communication
// stream. CPU tensors pass through untouched, so one body serves both; under the host device
// layer they are staged too, as device tensors are.
#pragma once

#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "backend/device_support.h"

namespace torus {

class HostStaging {
 public:
  // `stageCpu`: CPU tensors are the device's (the host device layer) and get host copies too.
  explicit HostStaging(bool stageCpu) : stageCpu_(stageCpu) {}

  // The tensor itself on the CPU; for a device tensor, a pinned host tensor of its shape that
  // holds its values once copyIn has run.
  at::Tensor input(const at::Tensor& tensor);
  // The tensor itself on the CPU; for a device tensor, a pinned host tensor of its shape whose
  // values copyOut writes into it.
  at::Tensor output(const at::Tensor& tensor);
  // Both: a tensor the collective reads and writes (broadcast's).
  at::Tensor inputOutput(const at::Tensor& tensor);
  std::vector<at::Tensor> inputs(const std::vector<at::Tensor>& tensors);
  std::vector<at::Tensor> outputs(const std::vector<at::Tensor>& tensors);

  // Worker, inside the call's device scope (device: null for a CPU call, and then nothing to do):
  // the inputs copied down, waited for until `deadline`.
  void copyIn(DeviceCall* device, Deadline deadline);
  // The outputs copied up, queued on the communication stream.
  void copyOut(DeviceCall* device);

 private:
  bool staged(const at::Tensor& tensor) const {
    return stageCpu_ || !tensor.device().is_cpu();
  }
  static at::Tensor pinnedLike(const at::Tensor& tensor);
  const bool stageCpu_;
  // (device tensor, host copy)
  std::vector<std::pair<at::Tensor, at::Tensor>> inputs_;
  std::vector<std::pair<at::Tensor, at::Tensor>> outputs_;
};

} // namespace torus
