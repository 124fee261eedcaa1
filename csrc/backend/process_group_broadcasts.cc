// The entry points that spread one rank's data, or none: broadcast, scatter and barrier.
#include "backend/process_group_torus.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"
#include "collectives/barrier_dissemination.h"
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
  return submit(call, {tensor}, {tensor}, opts.timeout, [this, tensor, root, algorithm](Comm& comm) mutable {
    at::Tensor buffer = contiguousBuffer(tensor);
    dispatch_.broadcast(algorithm, comm, buffer.data_ptr(), bytesOf(buffer), root);
    writeBack(tensor, buffer);
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
  return submit(call, {output}, inputList, opts.timeout, [output, inputList, root](Comm& comm) mutable {
    at::Tensor packed = comm.rank() == root ? packBytes(inputList) : at::Tensor();
    at::Tensor buffer = contiguousBuffer(output);
    scatter_direct(comm, packed.defined() ? packed.data_ptr() : nullptr, buffer.data_ptr(), bytesOf(buffer), root);
    writeBack(output, buffer);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::barrier(const c10d::BarrierOptions& opts) {
  return submit(CallDescription{c10d::OpType::BARRIER}, {}, {}, opts.timeout,
                [](Comm& comm) { barrier_dissemination(comm); });
}

} // namespace torus
