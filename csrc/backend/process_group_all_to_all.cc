// The all-to-all entry points: all_to_all_single (even or given splits) and all_to_all (lists).
#include "backend/host_staging.h"
#include "backend/process_group_torus.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"
#include "collectives/alltoallv_pairwise.h"

namespace torus {

namespace {

// Where each rank's part of one side of an all-to-all lies in its buffer, in bytes.
struct Parts {
  std::vector<size_t> offsets;
  std::vector<size_t> lengths;
  size_t total = 0;

  void add(size_t length) {
    offsets.push_back(total);
    lengths.push_back(length);
    total += length;
  }
};

// The dim-0 splits of `tensor` as byte parts; even splits when `splits` is empty.
Parts splitBytes(const at::Tensor& tensor, const std::vector<int64_t>& splits, int size, const char* what) {
  const int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
  const size_t rowBytes = rows == 0 ? 0 : bytesOf(tensor) / static_cast<size_t>(rows);
  std::vector<int64_t> rowsPerRank;
  if (splits.empty()) {
    TORUS_CHECK_ARG(rows % size == 0, "all_to_all_single ", what, " has ", rows,
                    " rows (size of dim 0), which the world size (", size, ") does not divide; pass ", what,
                    "_split_sizes");
    rowsPerRank.assign(static_cast<size_t>(size), rows / size);
  } else {
    TORUS_CHECK_ARG(splits.size() == static_cast<size_t>(size), "all_to_all_single ", what, "_split_sizes has ",
                    splits.size(), " entries but the group has ", size, " ranks");
    int64_t total = 0;
    for (size_t i = 0; i < splits.size(); ++i) {
      TORUS_CHECK_ARG(splits[i] >= 0 && splits[i] <= rows, "all_to_all_single ", what, "_split_sizes[", i, "] is ",
                      splits[i], "; split sizes must be between 0 and the ", what, "'s rows (", rows, ")");
      total += splits[i];
    }
    TORUS_CHECK_ARG(total == rows, "all_to_all_single ", what, "_split_sizes sum to ", total, " but ", what, " has ",
                    rows, " rows (size of dim 0)");
    rowsPerRank = splits;
  }
  Parts parts;
  for (int64_t r : rowsPerRank) {
    parts.add(static_cast<size_t>(r) * rowBytes);
  }
  return parts;
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                std::vector<int64_t>& outputSplits,
                                                                std::vector<int64_t>& inputSplits,
                                                                const c10d::AllToAllOptions& opts) {
  checkTensor(input, "all_to_all_single input");
  checkOutput(output, "all_to_all_single output");
  TORUS_CHECK_ARG(output.scalar_type() == input.scalar_type(), "all_to_all_single output has dtype ",
                  output.scalar_type(), " but input has ", input.scalar_type());
  const Parts sent = splitBytes(input, inputSplits, size_, "input");
  const Parts received = splitBytes(output, outputSplits, size_, "output");
  TORUS_CHECK_ARG(sent.lengths[rank_] == received.lengths[rank_], "all_to_all_single keeps ", sent.lengths[rank_],
                  " bytes of its own input (input_split_sizes[", rank_, "]) but expects ", received.lengths[rank_],
                  " in its output (output_split_sizes[", rank_, "])");
  // Totals may differ by rank (split sizes); each message's size is checked on arrival.
  const CallDescription call{c10d::OpType::ALLTOALL_BASE, input.scalar_type()};
  auto staging = std::make_shared<HostStaging>(devices_->stagesCpuTensors());
  at::Tensor hostInput = staging->input(input);
  at::Tensor hostOutput = staging->output(output);
  return submit(call, {output}, {input}, opts,
                [staging, hostOutput, hostInput, sent, received](Comm& comm, DeviceCall* device) mutable {
    staging->copyIn(device, comm.deadline());
    at::Tensor in = contiguousBuffer(hostInput);
    at::Tensor out = contiguousBuffer(hostOutput);
    if (in.numel() > 0 && in.data_ptr() == out.data_ptr()) {
      in = in.clone();
    }
    alltoallv_pairwise(comm, in.data_ptr(), sent.offsets, sent.lengths, out.data_ptr(), received.offsets,
                       received.lengths);
    writeBack(hostOutput, out);
    staging->copyOut(device);
  }, inputSplits, outputSplits);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::alltoall(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllToAllOptions& opts) {
  checkListLength(inputs.size(), size_, "all_to_all input_tensor_list");
  checkListLength(outputs.size(), size_, "all_to_all output_tensor_list");
  Parts sent, received;
  for (int i = 0; i < size_; ++i) {
    checkTensor(inputs[i], indexed("all_to_all input_tensor_list", i));
    checkOutput(outputs[i], indexed("all_to_all output_tensor_list", i));
    TORUS_CHECK_ARG(outputs[i].scalar_type() == inputs[0].scalar_type() &&
                        inputs[i].scalar_type() == inputs[0].scalar_type(),
                    "all_to_all tensors must share one dtype; input_tensor_list[0] has ", inputs[0].scalar_type(),
                    ", input_tensor_list[", i, "] has ", inputs[i].scalar_type(), ", output_tensor_list[", i,
                    "] has ", outputs[i].scalar_type());
    sent.add(bytesOf(inputs[i]));
    received.add(bytesOf(outputs[i]));
  }
  TORUS_CHECK_ARG(sent.lengths[rank_] == received.lengths[rank_], "all_to_all input_tensor_list[", rank_, "] has ",
                  sent.lengths[rank_], " bytes but output_tensor_list[", rank_, "] has ", received.lengths[rank_],
                  " (this rank's own block is copied, so they must match)");
  const CallDescription call{c10d::OpType::ALLTOALL, inputs[0].scalar_type()};
  auto staging = std::make_shared<HostStaging>(devices_->stagesCpuTensors());
  std::vector<at::Tensor> hostInputs = staging->inputs(inputs);
  std::vector<at::Tensor> hostOutputs = staging->outputs(outputs);
  return submit(call, outputs, inputs, opts,
                [staging, hostOutputs, hostInputs, sent, received](Comm& comm, DeviceCall* device) mutable {
    staging->copyIn(device, comm.deadline());
    at::Tensor packed = packBytes(hostInputs);
    at::Tensor buffer = at::empty({static_cast<int64_t>(received.total)}, at::kByte);
    alltoallv_pairwise(comm, packed.data_ptr(), sent.offsets, sent.lengths, buffer.data_ptr(), received.offsets,
                       received.lengths);
    for (size_t i = 0; i < hostOutputs.size(); ++i) {
      unpackBytes(hostOutputs[i], buffer.narrow(0, static_cast<int64_t>(received.offsets[i]),
                                                static_cast<int64_t>(received.lengths[i])));
    }
    staging->copyOut(device);
  });
}

} // namespace torus
