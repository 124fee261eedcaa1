// The reducing entry points: all_reduce (and coalesced; sparse tensors go to
// process_group_sparse_allreduce.cc), reduce, reduce_scatter (list, tensor,
// coalesced tensors).
#include "backend/log.h"
#include "backend/process_group_torus.h"
#include "backend/reduction.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"
#include "collectives/device/device_collectives.h"

namespace torus {

void ProcessGroupTorus::allreduceBuffer(Algorithm algorithm, Comm& comm, DeviceCall* device, at::Tensor& buffer,
                                        const Reduction& reduction) {
  const auto count = static_cast<size_t>(buffer.numel());
  if (device == nullptr) {
    dispatch_.allreduce(algorithm, comm, buffer.data_ptr(), count, reduction.reducer);
    return;
  }
  device->attachArenas(comm);
  logDeviceRoute(algorithm, dispatch_.deviceAllreduce(algorithm, comm, device->path(), reduction.onDevice,
                                                      buffer.data_ptr(), count));
}

void ProcessGroupTorus::logDeviceRoute(Algorithm algorithm, const DeviceRoutes& routes) const {
  if (config_.logLevel >= 2) {
    logLine(rank_, std::string("on the device, ") + algorithmName(algorithm) + " runs as " + describeRoutes(routes));
  }
}

void ProcessGroupTorus::allgatherBuffer(Algorithm algorithm, Comm& comm, DeviceCall* device, at::Tensor& buffer,
                                        const Blocks& blocks) {
  if (device == nullptr) {
    dispatch_.allgather(algorithm, comm, buffer.data_ptr(), blocks, buffer.element_size());
    return;
  }
  device->attachArenas(comm);
  logDeviceRoute(algorithm, dispatch_.deviceAllgather(comm, device->path(), buffer.data_ptr(), blocks,
                                                      buffer.element_size()));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allreduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  checkSingle(tensors.size(), "all_reduce");
  at::Tensor tensor = tensors[0];
  if (tensor.defined() && tensor.is_sparse()) {
    return allreduceSparse(tensor, opts);
  }
  checkOutput(tensor, "all_reduce tensor");
  auto [call, body] = denseAllreduce(tensor, opts.reduceOp);
  return submit(call, {tensor}, {tensor}, opts, std::move(body));
}

void ProcessGroupTorus::allreduceHere(at::Tensor& tensor, const c10d::ReduceOp& op) {
  checkOutput(tensor, "all_reduce_ tensor");
  auto [call, body] = denseAllreduce(tensor, op);
  {
    CommsEvent event;
    if (event.active()) {
      const std::vector<at::Tensor> tensors{tensor};
      event.begin(commsGroup(),
                  describeCollective(call.type, call.dtype, tensors, tensors, size_,
                                     static_cast<int64_t>(executor_->issued()) + 1, false),
                  tensors, tensors);
    }
    if (executor_->runHereIfIdle(call, timeout_.load(), body)) {
      return;
    }
  }
  c10d::AllreduceOptions opts;
  opts.asyncOp = false;
  submit(call, {tensor}, {tensor}, opts, std::move(body))->wait();
}

std::pair<CallDescription, CollectiveExecutor::Body> ProcessGroupTorus::denseAllreduce(const at::Tensor& tensor,
                                                                                       const c10d::ReduceOp& op) {
  auto reduction = Reduction::of(op, tensor.scalar_type(), "all_reduce");
  const Algorithm algorithm = dispatch_.algorithmFor("allreduce", bytesOf(tensor));
  const CallDescription call{c10d::OpType::ALLREDUCE, tensor.scalar_type(), bytesOf(tensor), op.op_, -1, algorithm};
  return {call, [this, tensor = tensor, reduction, algorithm](Comm& comm, DeviceCall* device) mutable {
            at::Tensor buffer = contiguousBuffer(tensor);
            reduction.prepare(buffer);
            allreduceBuffer(algorithm, comm, device, buffer, reduction);
            reduction.finish(buffer, tensor, size_);
          }};
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                      const c10d::AllreduceCoalescedOptions& opts) {
  TORUS_CHECK_ARG(!tensors.empty(), "all_reduce_coalesced tensors is empty; it needs at least one tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkOutput(tensors[i], indexed("all_reduce_coalesced tensors", i));
    TORUS_CHECK_ARG(tensors[i].scalar_type() == tensors[0].scalar_type(), "all_reduce_coalesced tensors[", i,
                    "] has dtype ", tensors[i].scalar_type(), " but tensors[0] has ", tensors[0].scalar_type());
  }
  auto reduction = Reduction::of(opts.reduceOp, tensors[0].scalar_type(), "all_reduce_coalesced");
  const size_t totalBytes = totalBytesOf(tensors);
  const Algorithm algorithm = dispatch_.algorithmFor("allreduce", totalBytes);
  const CallDescription call{c10d::OpType::ALLREDUCE_COALESCED, tensors[0].scalar_type(), totalBytes,
                             opts.reduceOp.op_, -1, algorithm};
  return submit(call, tensors, tensors, opts, [this, tensors, reduction, algorithm](Comm& comm, DeviceCall* device) mutable {
    at::Tensor buffer = concatenated(tensors);
    reduction.prepare(buffer);
    allreduceBuffer(algorithm, comm, device, buffer, reduction);
    int64_t offset = 0;
    for (auto& t : tensors) {
      at::Tensor part = buffer.narrow(0, offset, t.numel());
      reduction.finish(part, t, size_);
      offset += t.numel();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::reduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::ReduceOptions& opts) {
  checkSingle(tensors.size(), "reduce");
  checkRoot(opts.rootRank, size_, "reduce", "dst");
  at::Tensor tensor = tensors[0];
  checkOutput(tensor, "reduce tensor");
  auto reduction = Reduction::of(opts.reduceOp, tensor.scalar_type(), "reduce");
  const int root = static_cast<int>(opts.rootRank);
  const CallDescription call{c10d::OpType::REDUCE, tensor.scalar_type(), bytesOf(tensor), opts.reduceOp.op_, root};
  return submit(call, {tensor}, {tensor}, opts, [this, tensor, reduction, root](Comm& comm, DeviceCall* device) mutable {
    // Only the root's tensor is an output; the others keep their values.
    at::Tensor buffer =
        comm.rank() == root ? contiguousBuffer(tensor) : tensor.clone(at::MemoryFormat::Contiguous);
    reduction.prepare(buffer);
    if (device == nullptr) {
      dispatch_.reduce(comm, buffer.data_ptr(), static_cast<size_t>(buffer.numel()), reduction.reducer, root);
    } else {
      // On the device, the root's result is an allreduce's: the device routes keep every rank
      // busy either way, and there is one path less to keep right.
      allreduceBuffer(dispatch_.algorithmFor("allreduce", bytesOf(buffer)), comm, device, buffer, reduction);
    }
    if (comm.rank() == root) {
      reduction.finish(buffer, tensor, size_);
    }
  });
}

void ProcessGroupTorus::reduceScatterInto(Algorithm algorithm, Comm& comm, DeviceCall* device, at::Tensor& buffer,
                                          const Blocks& blocks, const Reduction& reduction, at::Tensor& output) {
  reduction.prepare(buffer);
  if (device == nullptr) {
    dispatch_.reduceScatter(algorithm, comm, buffer.data_ptr(), blocks, reduction.reducer);
  } else {
    device->attachArenas(comm);
    logDeviceRoute(algorithm,
                   dispatch_.deviceReduceScatter(comm, device->path(), reduction.onDevice, buffer.data_ptr(), blocks));
  }
  at::Tensor mine = buffer.narrow(0, static_cast<int64_t>(blocks.offsets[rank_]),
                                  static_cast<int64_t>(blocks.counts[rank_]));
  reduction.finish(mine, output, size_);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                 std::vector<std::vector<at::Tensor>>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) {
  checkSingle(outputs.size(), "reduce_scatter output");
  checkSingle(inputs.size(), "reduce_scatter input list");
  at::Tensor output = outputs[0];
  checkOutput(output, "reduce_scatter output");
  std::vector<at::Tensor> inputList = inputs[0];
  checkListLength(inputList.size(), size_, "reduce_scatter input_list");
  for (size_t i = 0; i < inputList.size(); ++i) {
    checkTensor(inputList[i], indexed("reduce_scatter input_list", i));
    TORUS_CHECK_ARG(inputList[i].scalar_type() == output.scalar_type(), "reduce_scatter input_list[", i,
                    "] has dtype ", inputList[i].scalar_type(), " but output has ", output.scalar_type());
  }
  TORUS_CHECK_ARG(inputList[rank_].numel() == output.numel(), "reduce_scatter input_list[", rank_, "] has ",
                  inputList[rank_].numel(), " elements but output (this rank's share) has ", output.numel());
  auto reduction = Reduction::of(opts.reduceOp, output.scalar_type(), "reduce_scatter");
  const size_t inputBytes = totalBytesOf(inputList);
  const Algorithm algorithm = dispatch_.algorithmFor("reduce_scatter", inputBytes);
  const CallDescription call{c10d::OpType::REDUCE_SCATTER, output.scalar_type(), inputBytes, opts.reduceOp.op_, -1,
                             algorithm};
  return submit(call, {output}, inputList, opts,
                [this, output, inputList, reduction, algorithm](Comm& comm, DeviceCall* device) mutable {
                  std::vector<size_t> counts;
                  for (const auto& t : inputList) {
                    counts.push_back(static_cast<size_t>(t.numel()));
                  }
                  at::Tensor buffer = concatenated(inputList);
                  reduceScatterInto(algorithm, comm, device, buffer, blocksOfCounts(counts), reduction, output);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                       const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORUS_CHECK_ARG(!inputs.empty() && outputs.size() == inputs.size(), "reduce_scatter_tensor has ", outputs.size(),
                  " outputs and ", inputs.size(), " inputs; it needs as many of each, at least one");
  std::vector<Reduction> reductions;
  std::vector<Algorithm> algorithms;
  for (size_t j = 0; j < inputs.size(); ++j) {
    const std::string what =
        inputs.size() == 1 ? "reduce_scatter_tensor" : "reduce_scatter_tensor " + std::to_string(j);
    checkTensor(inputs[j], what + " input");
    checkOutput(outputs[j], what + " output");
    TORUS_CHECK_ARG(outputs[j].scalar_type() == inputs[j].scalar_type(), what, " output has dtype ",
                    outputs[j].scalar_type(), " but input has ", inputs[j].scalar_type());
    TORUS_CHECK_ARG(inputs[j].numel() == outputs[j].numel() * size_, what, " input has ", inputs[j].numel(),
                    " elements; it needs world size (", size_, ") x output's elements (", outputs[j].numel(), ")");
    reductions.push_back(Reduction::of(opts.reduceOp, inputs[j].scalar_type(), "reduce_scatter_tensor"));
    algorithms.push_back(dispatch_.algorithmFor("reduce_scatter", bytesOf(inputs[j])));
  }
  const CallDescription call{c10d::OpType::_REDUCE_SCATTER_BASE, inputs[0].scalar_type(), totalBytesOf(inputs),
                             opts.reduceOp.op_, -1, algorithms[0]};
  return submit(call, outputs, inputs, opts,
                [this, outputs, inputs, reductions, algorithms](Comm& comm, DeviceCall* device) mutable {
                  for (size_t j = 0; j < inputs.size(); ++j) {
                    at::Tensor buffer = inputs[j].reshape({-1}).clone(at::MemoryFormat::Contiguous);
                    reduceScatterInto(algorithms[j], comm, device, buffer,
                                      equalBlocks(static_cast<size_t>(outputs[j].numel()), size_), reductions[j],
                                      outputs[j]);
                  }
                });
}

} // namespace torus
