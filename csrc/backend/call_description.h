// CallDescription: one collective call as every rank must agree on it — its kind, dtype,
// reduction, root, algorithm and size. The job's title (for profiler traces), the signature its
// messages carry and the text that describes it in a mismatch all follow from it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backend/algorithm_catalog.h"
#include "transport/transport.h"

namespace torus {

struct CallDescription {
  c10d::OpType type;
  at::ScalarType dtype = at::kByte;
  // The size as the collective counts it: the same on every rank of a correct program (0 for
  // calls whose sizes may differ by rank, whose messages are checked one by one).
  uint64_t nbytes = 0;
  std::optional<c10d::ReduceOp::RedOpType> op;
  int root = -1;
  std::optional<Algorithm> algorithm;

  // What every message of the call carries.
  CallSignature signature() const;
  // "torus:all_reduce:ring", "torus:barrier": a string that lives forever, as profiler traces
  // keep the pointer.
  const char* title() const;
};

// torch.distributed's name of a collective ("all_gather_into_tensor").
const char* collectiveName(c10d::OpType type);
// ProcessGroupNCCL's name of a collective ("_allgather_base"), as record_param_comms events
// carry it.
const char* ncclCollectiveName(c10d::OpType type);
// c10d's name of a reduction ("SUM").
const char* reduceOpName(c10d::ReduceOp::RedOpType op);
// "all_reduce of 4000 bytes float32 (sum, ring)", from a signature read off the wire.
std::string describeCall(const CallSignature& call);

} // namespace torus
