// TorusConfig: everything the Python shim resolved from TORUS_* variables and pg_options for
// one group.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/algorithm_catalog.h"
#include "comm/comm.h"
#include "transport/message_options.h"
#include "transport/spin_wait.h"
#include "transport/tcp/tcp_listener.h"

namespace torus {

// Use `algorithm` for calls of lo..hi bytes (inclusive).
struct AlgorithmRule {
  uint64_t lo = 0;
  uint64_t hi = UINT64_MAX;
  std::string algorithm;
};

// The largest collective (bytes of its tensors) that runs on the calling thread when the caller
// waits for it at once and nothing is queued (TORUS_INLINE_BYTES). Any size: from 4 KiB to 256 MiB,
// shm and tcp, 4 and 8 ranks, no size ran faster through the worker (BENCHMARKS.md,
// "TORUS_INLINE_BYTES: any size").
inline constexpr uint64_t kDefaultInlineBytes = UINT64_MAX;

struct TorusConfig {
  // "tcp", "shm" when every rank of the group shares this host's memory, "ofi", or "shm+tcp" /
  // "shm+ofi" (shared memory inside each host, the network transport between hosts).
  std::string transport = "tcp";
  std::string address = "127.0.0.1";
  // TORUS_OFI_PROVIDER: the libfabric provider of "ofi"; empty: libfabric's choice.
  std::string ofiProvider;
  // TORUS_OFI_RMA_BYTES: messages above this go by RMA reads over "ofi"; -1: the provider's
  // default (OfiOptions::rmaAbove).
  int64_t ofiRmaBytes = -1;
  int64_t chunkBytes = static_cast<int64_t>(Chunking().chunkBytes);
  // The message layer's flow control (MessageOptions).
  uint64_t eagerBytes = MessageOptions().eagerBytes;
  uint64_t eagerWindowBytes = MessageOptions().eagerWindowBytes;
  uint64_t inlineBytes = kDefaultInlineBytes;
  // TORUS_WAIT: how waits on shared memory spend their looks (SpinWait).
  WaitPolicy wait = WaitPolicy::kAuto;
  // Per collective ("allreduce", "allgather", "reduce_scatter", "broadcast"), rules that cover
  // every size: the user's TORUS_<COLLECTIVE> rules with the gaps filled by the automatic choice.
  // A collective without rules uses its first algorithm in the catalog.
  std::map<std::string, std::vector<AlgorithmRule>> algorithms;
  // The torus grid as rows of ranks (all rows the same length); empty when the world has none.
  std::vector<std::vector<int>> torusRows;
  std::string torusInner = algorithmName(Algorithm::kRing);
  // The host of each rank, as indices (ranks with the same index share a host); empty: all
  // ranks count as one host.
  std::vector<int> hosts;
  // 0 warn, 1 info, 2 debug.
  int logLevel = 0;
  // How long one phase of a device collective may wait (TORUS_DEVICE_STALL_TIMEOUT), ms.
  int64_t deviceStallMs = 30000;
  // TORUS_HOST_DEVICE: "off", "on", "stall:<step>" or "fail:enter" (DeviceOptions::hostDevice).
  std::string hostDevice = "off";
  // The flight recorder: how many calls it keeps (TORUS_TRACE_BUFFER; 0: off), and the directory
  // its dumps go to (this group's, under TORUS_TRACE_DIR).
  uint64_t traceBuffer = 2000;
  std::string traceDir;
  // TORUS_SHARED_TENSOR_CACHE: the most bytes of freed shared tensor segments the process keeps
  // for reuse (SharedTensorArena); -1: as many as its shared tensors held at their peak.
  int64_t sharedTensorCache = -1;
  // The group's secret (transport/group_secret.h), which rank 0 drew and every rank learned when
  // the ranks met in the store; a group of one or over shared memory alone needs none.
  std::string secret;
  // The socket TCP accepts on, opened before the ranks met: its address travelled in this rank's
  // record and rank 0 published it (TcpOptions::listener). Null: TCP opens its own.
  std::shared_ptr<TcpListener> tcpListener;
};

} // namespace torus
