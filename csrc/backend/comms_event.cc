#include "backend/comms_event.h"

#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include "backend/call_description.h"

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
  CommsCall call{ncclCollectiveName(type), seq, false, totalNumel(inputs), totalNumel(outputs), dtype,
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
    case c10d::OpType::_REDUCE_SCATTER_BASE: // reduce_scatter_tensor_coalesced is one of them
      if (inputs.size() > 1) {
        call.name = "reduce_scatter_tensor_coalesced";
      }
      break;
    case c10d::OpType::ALLTOALL_BASE: // all_to_all_single: NCCL's all_to_allv only with splits
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
