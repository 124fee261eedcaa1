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

const char* collectiveName(c10d::OpType type) {
  switch (type) {
    case c10d::OpType::BROADCAST:
      return "broadcast";
    case c10d::OpType::ALLREDUCE:
      return "all_reduce";
    case c10d::OpType::ALLREDUCE_COALESCED:
      return "all_reduce_coalesced";
    case c10d::OpType::REDUCE:
      return "reduce";
    case c10d::OpType::ALLGATHER:
      return "all_gather";
    case c10d::OpType::_ALLGATHER_BASE:
      return "all_gather_into_tensor";
    case c10d::OpType::ALLGATHER_COALESCED:
      return "all_gather_coalesced";
    case c10d::OpType::COALESCED:
      return "all_gather_into_tensor_coalesced";
    case c10d::OpType::GATHER:
      return "gather";
    case c10d::OpType::SCATTER:
      return "scatter";
    case c10d::OpType::REDUCE_SCATTER:
      return "reduce_scatter";
    case c10d::OpType::_REDUCE_SCATTER_BASE:
      return "reduce_scatter_tensor";
    case c10d::OpType::ALLTOALL_BASE:
      return "all_to_all_single";
    case c10d::OpType::ALLTOALL:
      return "all_to_all";
    case c10d::OpType::BARRIER:
      return "barrier";
    default:
      return "a collective";
  }
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
