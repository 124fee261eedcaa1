// CommsEvent: the record_param_comms event ProcessGroupNCCL and ProcessGroupGloo's peers emit for
// every call (torch's ParamCommsUtils.hpp): the collective's name, element counts, dtype, split
// sizes, sequence number, the group's name and ranks. Kineto's trace, HTA and Chakra read it. It
// is a scope on the thread that issues the call, opened before the call's work (whose
// "torus:all_reduce:<algorithm>" span it encloses) and closed when the call returns; a call that
// runs on that thread runs inside it. Nothing is built unless a profiler records this thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace torus {

// The group as the events name it: torch's name and description of it, and where its ranks lie
// in the world (start and stride; stride -1 when they are not evenly spaced).
struct CommsGroup {
  std::string name;
  std::string description;
  int rank = 0;
  int size = 0;
  int globalRankStart = 0;
  int globalRankStride = 1;
};

// One call, as the event describes it.
struct CommsCall {
  const char* name; // NCCL's name for it: "allreduce", "_allgather_base", "send", "coalesced"
  int64_t seq; // collectives and point-to-point calls are numbered apart
  bool p2p;
  int64_t inNelems;
  int64_t outNelems;
  at::ScalarType dtype;
  std::vector<int64_t> inSplits;
  std::vector<int64_t> outSplits;
  bool asyncOp;
};

// The elements of all of `tensors`.
int64_t totalNumel(const std::vector<at::Tensor>& tensors);

// A collective of `type` on these tensors (as its entry point hands them to the executor),
// numbered `seq`, in a group of `size`; the splits of all_to_all_single (empty: even).
CommsCall describeCollective(c10d::OpType type, at::ScalarType dtype, const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& outputs, int size, int64_t seq, bool asyncOp,
                             c10::ArrayRef<int64_t> inSplits = {}, c10::ArrayRef<int64_t> outSplits = {});

class CommsEvent {
 public:
  CommsEvent() : guard_(at::RecordScope::FUNCTION) {}
  CommsEvent(const CommsEvent&) = delete;
  CommsEvent& operator=(const CommsEvent&) = delete;

  // Whether a profiler records this thread: only then is the call worth describing.
  bool active() const {
    return guard_.isActive();
  }
  // Opens the event (only when active()); it ends with this object.
  void begin(const CommsGroup& group, const CommsCall& call, const std::vector<at::Tensor>& inputs,
             const std::vector<at::Tensor>& outputs);

 private:
  // Declared in this order so that the event ends while its metadata and inputs are still set, as
  // RECORD_PARAM_COMMS_DATA's scope does.
  std::optional<c10::DebugInfoGuard> info_;
  std::vector<c10::IValue> inputs_;
  at::RecordFunction guard_;
};

} // namespace torus
