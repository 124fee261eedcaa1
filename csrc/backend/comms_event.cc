#include "backend/comms_event.h"

#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

namespace torus {

namespace {

std::vector<int64_t> numels(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> all;
  all.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) {
    all.push_back(tensor.numel());
  }
  return all;
}

// ProcessGroupNCCL's names, which trace tools match.
const char* ncclName(c10d::OpType type, size_t tensors) {
  switch (type) {
    case c10d::OpType::BROADCAST:
      return "broadcast";
    case c10d::OpType::ALLREDUCE:
      return "allreduce";
    case c10d::OpType::ALLREDUCE_COALESCED:
      return "allreduce_coalesced";
    case c10d::OpType::REDUCE:
      return "reduce";
    case c10d::OpType::ALLGATHER:
      return "all_gather";
    case c10d::OpType::_ALLGATHER_BASE:
      return "_allgather_base";
    case c10d::OpType::ALLGATHER_COALESCED:
      return "allgather_coalesced";
    case c10d::OpType::COALESCED:
      return "allgather_into_tensor_coalesced";
    case c10d::OpType::GATHER:
      return "gather";
    case c10d::OpType::SCATTER:
      return "scatter";
    case c10d::OpType::REDUCE_SCATTER:
      return "reduce_scatter";
    case c10d::OpType::_REDUCE_SCATTER_BASE:
      return tensors > 1 ? "reduce_scatter_tensor_coalesced" : "_reduce_scatter_base";
    case c10d::OpType::ALLTOALL_BASE:
      return "all_to_allv";
    case c10d::OpType::ALLTOALL:
      return "all_to_all";
    case c10d::OpType::BARRIER:
      return "barrier";
    default:
      return "collective";
  }
}

} // namespace

int64_t totalNumel(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& tensor : tensors) {
    total += tensor.defined() ? tensor.numel() : 0;
  }
  return total;
}

CommsCall describeCollective(c10d::OpType type, at::ScalarType dtype, const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& outputs, int size, int64_t seq, bool asyncOp,
                             c10::ArrayRef<int64_t> inSplits, c10::ArrayRef<int64_t> outSplits) {
  CommsCall call{ncclName(type, inputs.size()), seq, false, totalNumel(inputs), totalNumel(outputs), dtype,
                 inSplits.vec(), outSplits.vec(), asyncOp};
  // The coalesced calls describe themselves in bytes; the event names the tensors' dtype.
  if (!inputs.empty() && inputs[0].defined()) {
    call.dtype = inputs[0].scalar_type();
  }
  switch (type) {
    case c10d::OpType::GATHER: // only the root has outputs
      call.outNelems = call.inNelems * size;
      break;
    case c10d::OpType::SCATTER: // only the root has inputs
      call.inNelems = call.outNelems * size;
      break;
    case c10d::OpType::ALLTOALL_BASE:
      if (inSplits.empty() && outSplits.empty()) {
        call.name = "all_to_all";
      }
      break;
    case c10d::OpType::ALLTOALL:
      call.inSplits = numels(inputs);
      call.outSplits = numels(outputs);
      break;
    default:
      break;
  }
  return call;
}

void CommsEvent::begin(const CommsGroup& group, const CommsCall& call, const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& outputs) {
  auto info = std::make_shared<torch::ParamCommsDebugInfo>(
      std::make_tuple(group.name, group.description), group.rank, std::string(call.name), call.inNelems,
      call.outNelems, call.dtype, call.inSplits, call.outSplits, group.globalRankStart, group.globalRankStride,
      group.size, call.asyncOp);
  info->setSequenceInfo(call.seq, call.p2p);
  info_.emplace(c10::DebugInfoKind::PARAM_COMMS_INFO, std::move(info));
  // The inputs RECORD_PARAM_COMMS_DATA gives, in its order.
  inputs_ = {c10::IValue(inputs),
             c10::IValue(std::make_tuple(call.seq, call.p2p)),
             c10::IValue(std::make_tuple(group.name, group.description)),
             c10::IValue(group.rank),
             c10::IValue(call.name),
             c10::IValue(call.inSplits),
             c10::IValue(call.outSplits),
             c10::IValue(group.globalRankStart),
             c10::IValue(group.globalRankStride),
             c10::IValue(group.size),
             c10::IValue(call.asyncOp)};
  if (guard_.needsInputs()) {
    guard_.before(at::kParamCommsCallName, c10::ArrayRef<const c10::IValue>(inputs_.data(), inputs_.size()));
  } else {
    guard_.before(at::kParamCommsCallName);
  }
  if (guard_.needsOutputs()) {
    guard_.setOutputs(std::vector<c10::IValue>{c10::IValue(outputs)});
  }
}

} // namespace torus
