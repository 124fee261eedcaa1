// The gathering entry points: all_gather (list, into tensor, coalesced, into tensor coalesced)
// and gather.
#include "backend/host_staging.h"
#include "backend/process_group_torus.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"
#include "collectives/gather_direct.h"

namespace torus {

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  checkSingle(inputs.size(), "all_gather input");
  checkSingle(outputs.size(), "all_gather output list");
  at::Tensor input = inputs[0];
  checkTensor(input, "all_gather tensor (the input)");
  std::vector<at::Tensor> outputList = outputs[0];
  checkListLength(outputList.size(), size_, "all_gather tensor_list (the output list)");
  for (size_t i = 0; i < outputList.size(); ++i) {
    checkSameKind(outputList[i], input, indexed("all_gather tensor_list", i), "the input tensor", true);
  }
  const Algorithm algorithm = dispatch_.algorithmFor("allgather", bytesOf(input) * size_);
  const CallDescription call{c10d::OpType::ALLGATHER, input.scalar_type(), bytesOf(input) * size_, std::nullopt, -1,
                             algorithm};
  return submit(call, outputList, {input}, opts, [this, input, outputList, algorithm](Comm& comm, DeviceCall* device) mutable {
    const auto count = input.numel();
    at::Tensor gathered = at::empty({count * size_}, input.options());
    gathered.narrow(0, count * rank_, count).copy_(input.reshape({-1}));
    allgatherBuffer(algorithm, comm, device, gathered, equalBlocks(static_cast<size_t>(count), size_));
    for (int i = 0; i < size_; ++i) {
      writeBack(outputList[i], gathered.narrow(0, count * i, count));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::AllgatherOptions& opts) {
  checkTensor(input, "all_gather_into_tensor input_tensor");
  checkOutput(output, "all_gather_into_tensor output_tensor");
  TORUS_CHECK_ARG(output.scalar_type() == input.scalar_type(), "all_gather_into_tensor output_tensor has dtype ",
                  output.scalar_type(), " but input_tensor has ", input.scalar_type());
  TORUS_CHECK_ARG(output.numel() == input.numel() * size_, "all_gather_into_tensor output_tensor has ", output.numel(),
                  " elements; it needs world size (", size_, ") x input_tensor's elements (", input.numel(), ")");
  const Algorithm algorithm = dispatch_.algorithmFor("allgather", bytesOf(output));
  const CallDescription call{c10d::OpType::_ALLGATHER_BASE, output.scalar_type(), bytesOf(output), std::nullopt, -1,
                             algorithm};
  return submit(call, {output}, {input}, opts, [this, input, output, algorithm](Comm& comm, DeviceCall* device) mutable {
    const auto count = input.numel();
    at::Tensor buffer = output.is_contiguous() ? output : at::empty({output.numel()}, output.options());
    buffer.view({-1}).narrow(0, count * rank_, count).copy_(input.reshape({-1}));
    allgatherBuffer(algorithm, comm, device, buffer, equalBlocks(static_cast<size_t>(count), size_));
    writeBack(output, buffer);
  });
}

at::Tensor ProcessGroupTorus::allgatherBytes(Comm& comm, const at::Tensor& mine) {
  return allgatherBlocks(comm, mine,
                         std::vector<size_t>(static_cast<size_t>(comm.size()), static_cast<size_t>(mine.numel())));
}

at::Tensor ProcessGroupTorus::allgatherBlocks(Comm& comm, const at::Tensor& mine, const std::vector<size_t>& counts) {
  const Blocks blocks = blocksOfCounts(counts);
  const size_t elementSize = mine.element_size();
  at::Tensor gathered = at::empty({static_cast<int64_t>(spanOf(blocks))}, mine.options());
  const size_t mineBytes = counts[comm.rank()] * elementSize;
  if (mineBytes > 0) {
    std::memcpy(static_cast<char*>(gathered.data_ptr()) + blocks.offsets[comm.rank()] * elementSize, mine.data_ptr(),
                mineBytes);
  }
  dispatch_.allgather(dispatch_.algorithmFor("allgather", bytesOf(gathered)), comm, gathered.data_ptr(), blocks,
                      elementSize);
  return gathered;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                      std::vector<at::Tensor>& inputs,
                                                                      const c10d::AllgatherOptions& opts) {
  TORUS_CHECK_ARG(outputLists.size() == static_cast<size_t>(size_), "all_gather_coalesced output_tensor_lists has ",
                  outputLists.size(), " lists but the group has ", size_, " ranks; it needs one per rank");
  for (size_t j = 0; j < inputs.size(); ++j) {
    checkTensor(inputs[j], indexed("all_gather_coalesced input_tensor_list", j));
  }
  std::vector<at::Tensor> flatOutputs;
  for (size_t i = 0; i < outputLists.size(); ++i) {
    TORUS_CHECK_ARG(outputLists[i].size() == inputs.size(), "all_gather_coalesced output_tensor_lists[", i, "] has ",
                    outputLists[i].size(), " tensors but input_tensor_list has ", inputs.size());
    for (size_t j = 0; j < inputs.size(); ++j) {
      checkSameKind(outputLists[i][j], inputs[j],
                    indexed(indexed("all_gather_coalesced output_tensor_lists", i), j),
                    indexed("input_tensor_list", j), true);
      flatOutputs.push_back(outputLists[i][j]);
    }
  }
  const CallDescription call{c10d::OpType::ALLGATHER_COALESCED, at::kByte, totalBytesOf(inputs)};
  auto staging = std::make_shared<HostStaging>(devices_->stagesCpuTensors());
  std::vector<at::Tensor> hostInputs = staging->inputs(inputs);
  std::vector<std::vector<at::Tensor>> hostOutputLists;
  for (const auto& list : outputLists) {
    hostOutputLists.push_back(staging->outputs(list));
  }
  return submit(call, flatOutputs, inputs, opts,
                [this, staging, hostInputs, hostOutputLists](Comm& comm, DeviceCall* device) mutable {
    staging->copyIn(device, comm.deadline());
    at::Tensor gathered = allgatherBytes(comm, packBytes(hostInputs));
    const int64_t blockBytes = gathered.numel() / size_;
    for (int i = 0; i < size_; ++i) {
      int64_t offset = blockBytes * i;
      for (auto& out : hostOutputLists[i]) {
        auto n = static_cast<int64_t>(bytesOf(out));
        unpackBytes(out, gathered.narrow(0, offset, n));
        offset += n;
      }
    }
    staging->copyOut(device);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                  std::vector<at::Tensor>& inputs,
                                                                                  const c10d::AllgatherOptions& opts) {
  TORUS_CHECK_ARG(outputs.size() == inputs.size(), "all_gather_into_tensor (coalesced) has ", outputs.size(),
                  " outputs but ", inputs.size(), " inputs");
  for (size_t j = 0; j < inputs.size(); ++j) {
    checkTensor(inputs[j], "all_gather_into_tensor (coalesced) input " + std::to_string(j));
    checkOutput(outputs[j], "all_gather_into_tensor (coalesced) output " + std::to_string(j));
    TORUS_CHECK_ARG(outputs[j].scalar_type() == inputs[j].scalar_type() &&
                        outputs[j].numel() == inputs[j].numel() * size_,
                    "all_gather_into_tensor (coalesced) output ", j, " has dtype ", outputs[j].scalar_type(), " and ",
                    outputs[j].numel(), " elements; it needs input ", j, "'s dtype (", inputs[j].scalar_type(),
                    ") and world size (", size_, ") x its elements (", inputs[j].numel(), ")");
  }
  const CallDescription call{c10d::OpType::COALESCED, at::kByte, totalBytesOf(inputs)};
  auto staging = std::make_shared<HostStaging>(devices_->stagesCpuTensors());
  std::vector<at::Tensor> hostInputs = staging->inputs(inputs);
  std::vector<at::Tensor> hostOutputs = staging->outputs(outputs);
  return submit(call, outputs, inputs, opts,
                [this, staging, hostInputs, hostOutputs](Comm& comm, DeviceCall* device) mutable {
    staging->copyIn(device, comm.deadline());
    at::Tensor gathered = allgatherBytes(comm, packBytes(hostInputs));
    const int64_t blockBytes = gathered.numel() / size_;
    int64_t offset = 0;
    for (size_t j = 0; j < hostInputs.size(); ++j) {
      const auto n = static_cast<int64_t>(bytesOf(hostInputs[j]));
      std::vector<at::Tensor> pieces;
      for (int i = 0; i < size_; ++i) {
        pieces.push_back(gathered.narrow(0, blockBytes * i + offset, n));
      }
      unpackBytes(hostOutputs[j], at::cat(pieces));
      offset += n;
    }
    staging->copyOut(device);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::GatherOptions& opts) {
  checkRoot(opts.rootRank, size_, "gather", "dst");
  checkSingle(inputs.size(), "gather input");
  at::Tensor input = inputs[0];
  checkTensor(input, "gather tensor (the input)");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outputList = checkRootList(
      outputs, {"gather", "gather_list", "output list", "dst", "the input tensor", true}, rank_, root, size_, input);
  const CallDescription call{c10d::OpType::GATHER, input.scalar_type(), bytesOf(input), std::nullopt, root};
  auto staging = std::make_shared<HostStaging>(devices_->stagesCpuTensors());
  at::Tensor hostInput = staging->input(input);
  std::vector<at::Tensor> hostOutputs = staging->outputs(outputList);
  return submit(call, outputList, {input}, opts,
                [this, staging, hostInput, hostOutputs, root](Comm& comm, DeviceCall* device) mutable {
    staging->copyIn(device, comm.deadline());
    at::Tensor in = contiguousBuffer(hostInput);
    const auto nbytes = static_cast<int64_t>(bytesOf(in));
    at::Tensor gathered;
    if (comm.rank() == root) {
      gathered = at::empty({nbytes * size_}, at::kByte);
    }
    gather_direct(comm, in.data_ptr(), static_cast<size_t>(nbytes),
                  root == comm.rank() ? gathered.data_ptr() : nullptr, root);
    for (int i = 0; i < static_cast<int>(hostOutputs.size()); ++i) {
      unpackBytes(hostOutputs[i], gathered.narrow(0, nbytes * i, nbytes));
    }
    staging->copyOut(device);
  });
}

} // namespace torus
