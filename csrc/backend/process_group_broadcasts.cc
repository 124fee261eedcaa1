// The entry points that spread one rank's data, or none: broadcast, scatter and barrier.
#include "backend/host_staging.h"
#include "backend/process_group_torus.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"
#include "collectives/scatter_direct.h"

namespace torus {

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::broadcast(std::vector<at::Tensor>& tensors,
                                                            const c10d::BroadcastOptions& opts) {
  checkSingle(tensors.size(), "broadcast");
  checkRoot(opts.rootRank, size_, "broadcast", "src");
  at::Tensor tensor = tensors[0];
  checkOutput(tensor, "broadcast tensor");
  const int root = static_cast<int>(opts.rootRank);
  const Algorithm algorithm = dispatch_.algorithmFor("broadcast", bytesOf(tensor));
  const CallDescription call{c10d::OpType::BROADCAST, tensor.scalar_type(), bytesOf(tensor), std::nullopt, root,
                             algorithm};
  auto staging = std::make_shared<HostStaging>(devices_->stagesCpuTensors());
  at::Tensor host = staging->inputOutput(tensor);
  return submit(call, {tensor}, {tensor}, opts,
                [this, staging, host, root, algorithm](Comm& comm, DeviceCall* device) mutable {
                  staging->copyIn(device, comm.deadline());
                  at::Tensor buffer = contiguousBuffer(host);
                  dispatch_.broadcast(algorithm, comm, buffer.data_ptr(), bytesOf(buffer), root);
                  writeBack(host, buffer);
                  staging->copyOut(device);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ScatterOptions& opts) {
  checkRoot(opts.rootRank, size_, "scatter", "src");
  checkSingle(outputs.size(), "scatter output");
  at::Tensor output = outputs[0];
  checkOutput(output, "scatter tensor (the output)");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> inputList = checkRootList(
      inputs, {"scatter", "scatter_list", "input list", "src", "the output tensor", false}, rank_, root, size_, output);
  const CallDescription call{c10d::OpType::SCATTER, output.scalar_type(), bytesOf(output), std::nullopt, root};
  auto staging = std::make_shared<HostStaging>(devices_->stagesCpuTensors());
  at::Tensor hostOutput = staging->output(output);
  std::vector<at::Tensor> hostInputs = staging->inputs(inputList);
  return submit(call, {output}, inputList, opts,
                [staging, hostOutput, hostInputs, root](Comm& comm, DeviceCall* device) mutable {
                  staging->copyIn(device, comm.deadline());
                  at::Tensor packed = comm.rank() == root ? packBytes(hostInputs) : at::Tensor();
                  at::Tensor buffer = contiguousBuffer(hostOutput);
                  scatter_direct(comm, packed.defined() ? packed.data_ptr() : nullptr, buffer.data_ptr(),
                                 bytesOf(buffer), root);
                  writeBack(hostOutput, buffer);
                  staging->copyOut(device);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::barrier(const c10d::BarrierOptions& opts) {
  const Algorithm algorithm = dispatch_.algorithmFor("barrier", 0);
  CallDescription call{c10d::OpType::BARRIER};
  call.algorithm = algorithm;
  return submit(call, {}, {}, opts,
                [this, algorithm](Comm& comm, DeviceCall*) { dispatch_.barrier(algorithm, comm); });
}

} // namespace torus
