#include "backend/call_description.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

namespace torus {

CallSignature CallDescription::signature() const {
  CallSignature call;
  call.kind = static_cast<uint8_t>(static_cast<int>(type) + 1);
  call.dtype = static_cast<uint8_t>(dtype);
  call.op = op ? static_cast<uint8_t>(*op + 1) : 0;
  call.algorithm = algorithm ? static_cast<uint8_t>(static_cast<int>(*algorithm) + 1) : 0;
  call.root = root;
  call.nbytes = nbytes;
  return call;
}

const char* CallDescription::title() const {
  static std::mutex mutex;
  static std::map<std::pair<c10d::OpType, int>, std::string> titles;
  std::lock_guard<std::mutex> lock(mutex);
  auto& title = titles[{type, algorithm ? static_cast<int>(*algorithm) : -1}];
  if (title.empty()) {
    title = std::string("torus:") + collectiveName(type);
    if (algorithm) {
      title += std::string(":") + algorithmName(*algorithm);
    }
  }
  return title.c_str();
}

namespace {

// Each collective's names: torch.distributed's, and ProcessGroupNCCL's (which record_param_comms
// events carry and trace tools match).
struct CollectiveNames {
  c10d::OpType type;
  const char* torch;
  const char* nccl;
};

constexpr CollectiveNames kCollectiveNames[] = {
    {c10d::OpType::BROADCAST, "broadcast", "broadcast"},
    {c10d::OpType::ALLREDUCE, "all_reduce", "allreduce"},
    {c10d::OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", "allreduce_coalesced"},
    {c10d::OpType::REDUCE, "reduce", "reduce"},
    {c10d::OpType::ALLGATHER, "all_gather", "all_gather"},
    {c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", "_allgather_base"},
    {c10d::OpType::ALLGATHER_COALESCED, "all_gather_coalesced", "allgather_coalesced"},
    {c10d::OpType::COALESCED, "all_gather_into_tensor_coalesced", "allgather_into_tensor_coalesced"},
    {c10d::OpType::GATHER, "gather", "gather"},
    {c10d::OpType::SCATTER, "scatter", "scatter"},
    {c10d::OpType::REDUCE_SCATTER, "reduce_scatter", "reduce_scatter"},
    {c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", "_reduce_scatter_base"},
    {c10d::OpType::ALLTOALL_BASE, "all_to_all_single", "all_to_allv"},
    {c10d::OpType::ALLTOALL, "all_to_all", "all_to_all"},
    {c10d::OpType::BARRIER, "barrier", "barrier"},
};

const CollectiveNames* namesOf(c10d::OpType type) {
  for (const CollectiveNames& names : kCollectiveNames) {
    if (names.type == type) {
      return &names;
    }
  }
  return nullptr;
}

} // namespace

const char* collectiveName(c10d::OpType type) {
  const CollectiveNames* names = namesOf(type);
  return names ? names->torch : "a collective";
}

const char* ncclCollectiveName(c10d::OpType type) {
  const CollectiveNames* names = namesOf(type);
  return names ? names->nccl : "collective";
}

const char* reduceOpName(c10d::ReduceOp::RedOpType op) {
  static const char* const names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  const auto index = static_cast<size_t>(op);
  return index < std::size(names) ? names[index] : "UNUSED";
}

std::string describeCall(const CallSignature& call) {
  std::ostringstream out;
  // A peer's call comes off the wire: a dtype this build does not know is named by its number.
  out << collectiveName(static_cast<c10d::OpType>(call.kind - 1)) << " of " << call.nbytes << " bytes ";
  if (call.dtype < static_cast<uint8_t>(at::ScalarType::NumOptions)) {
    out << c10::getDtypeNames(static_cast<at::ScalarType>(call.dtype)).first;
  } else {
    out << "dtype " << static_cast<int>(call.dtype);
  }
  std::vector<std::string> details;
  if (call.op != 0) {
    std::string op = call.op <= 9 ? reduceOpName(static_cast<c10d::ReduceOp::RedOpType>(call.op - 1))
                                  : "an unknown reduction";
    std::transform(op.begin(), op.end(), op.begin(), [](unsigned char c) { return std::tolower(c); });
    details.push_back(op);
  }
  if (call.root >= 0) {
    details.push_back("root " + std::to_string(call.root));
  }
  if (call.algorithm != 0) {
    details.push_back(algorithmName(static_cast<Algorithm>(call.algorithm - 1)));
  }
  if (call.origin == CallSignature::kOriginCallback) {
    details.push_back("issued by a future's callback");
  }
  for (size_t i = 0; i < details.size(); ++i) {
    out << (i == 0 ? " (" : ", ") << details[i] << (i + 1 == details.size() ? ")" : "");
  }
  return out.str();
}

} // namespace torus
