// ProcessGroupTorus: the c10d::Backend behind torch.distributed's "torus".
//
// It validates tensors on the calling thread (so bad arguments fail before any bytes move),
// turns each collective into a job on the group's single worker thread — jobs run in issue
// order, which is the same on every rank — and returns a TorusWork at once. Sends and receives
// go straight to the transport so that a rank's isend and irecv can never block each other.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/arrival_board.h"
#include "backend/torus_work.h"
#include "collectives/allreduce.h"
#include "collectives/blocks.h"
#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// Use `algorithm` for calls of lo..hi bytes (inclusive).
struct AlgorithmRule {
  uint64_t lo = 0;
  uint64_t hi = UINT64_MAX;
  std::string algorithm;
};

// Everything the Python shim resolved from TORUS_* variables and pg_options.
struct TorusConfig {
  // "tcp", or "shm" when every rank of the group shares this host's memory.
  std::string transport = "tcp";
  std::string address = "127.0.0.1";
  int64_t chunkBytes = 512 * 1024;
  // Per collective ("allreduce", "allgather", "reduce_scatter", "broadcast"), rules that cover
  // every size: the user's TORUS_<COLLECTIVE> rules with the gaps filled by the automatic choice.
  // A collective without rules uses its first algorithm (ring, ring, ring, binomial).
  std::map<std::string, std::vector<AlgorithmRule>> algorithms;
  // The torus grid as rows of ranks (all rows the same length); empty when the world has none.
  std::vector<std::vector<int>> torusRows;
  std::string torusInner = "ring";
  // The host of each rank, as indices (ranks with the same index share a host); empty: all
  // ranks count as one host.
  std::vector<int> hosts;
  // 0 warn, 1 info, 2 debug.
  int logLevel = 0;
};

enum class Algorithm : uint8_t {
  kRing,
  kTorus,
  kDirect,
  kRecursiveDoubling,
  kRabenseifner,
  kOneShot,
  kTwoShot,
  kBinomial,
  kChain,
};
const char* algorithmName(Algorithm algorithm);

class ProcessGroupTorus : public c10d::Backend {
 public:
  ProcessGroupTorus(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    std::chrono::milliseconds timeout, TorusConfig config, std::string groupName);
  ~ProcessGroupTorus() override;

  const std::string getBackendName() const override {
    return "torus";
  }
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ = timeout;
  }
  const TorusConfig& config() const {
    return config_;
  }
  // What this group's collectives and sends have sent so far, by where the peer lives.
  TrafficCounters::Snapshot traffic() const {
    return traffic_->snapshot();
  }
  void resetTraffic() {
    traffic_->reset();
  }
  // The algorithm this group runs `collective` with for a call of `nbytes` bytes (the size of
  // the largest buffer of the call: allreduce and broadcast its tensor, allgather its output,
  // reduce_scatter its input — as nccl-tests count).
  Algorithm algorithmFor(const std::string& collective, uint64_t nbytes) const;
  // algorithm, or what runs in its place when this group cannot run it.
  Algorithm usable(Algorithm algorithm, uint64_t nbytes) const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits, std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;

  // Waits for queued jobs, then releases the worker thread and connections.
  void shutdown() override;
  // Fails pending and queued jobs at once and releases everything.
  void abort() override;

 private:
  using Body = std::function<void(Comm&)>;

  // Queues `body` on the worker thread; the returned work completes with `outputs`. Every message
  // of the collective carries `call`, which every rank must agree on.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs, std::chrono::milliseconds timeout,
                                         CallSignature call, Body body);
  void runWorker();
  std::chrono::milliseconds timeoutOf(std::chrono::milliseconds requested) const;
  void stopWorker(bool abortPending);
  // Raises DistBackendError naming `context` and the group's earlier failure, if there is one.
  void checkUsable(const std::string& context) const;
  // "torus:send to rank 2 tag 0, p2p #3 (rank 0, group '5')", numbering this call.
  std::string p2pContext(const std::string& what);

  // One reduction, as the collectives see it, plus the element-wise work torch's ops add around
  // the sum (AVG divides after, PREMUL_SUM multiplies before).
  struct Reduction {
    Reducer reducer;
    double preScale = 1.0;
    bool average = false;
  };
  Reduction reductionFor(const c10d::ReduceOp& op, at::ScalarType dtype, const char* collective) const;
  void applyPreScale(const Reduction& reduction, at::Tensor& tensor) const;
  void applyAverage(const Reduction& reduction, at::Tensor& tensor) const;

  void runAllreduce(Algorithm algorithm, Comm& comm, void* buf, size_t count, const Reducer& reducer);
  void runAllgather(Algorithm algorithm, Comm& comm, void* buf, const Blocks& blocks, size_t elementSize);
  void runReduceScatter(Algorithm algorithm, Comm& comm, void* buf, const Blocks& blocks, const Reducer& reducer);
  // Allgather of byte blocks: every rank contributes `mine` (the same length on every rank);
  // returns world-size blocks back to back.
  at::Tensor allgatherBytes(Comm& comm, const at::Tensor& mine);
  // "torus:all_reduce:ring" and the like, for profiler traces: a string that lives forever.
  static const char* titleOf(const char* collective, Algorithm algorithm);

  struct SelectionRule {
    uint64_t lo;
    uint64_t hi;
    Algorithm algorithm;
  };
  std::map<std::string, std::vector<SelectionRule>> selection_;
  TorusGrid grid_;
  AllreduceFn torusInner_ = nullptr;
  // What the shared-memory allreduces need: set when the transport is shm.
  bool sharedMemory_ = false;
  bool singleCopy_ = false;

  TorusConfig config_;
  std::string groupName_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<TrafficCounters> traffic_;
  std::unique_ptr<Comm> comm_;
  std::shared_ptr<ArrivalBoard> arrivals_; // shared with the works, whose wait(timeout) reads it
  Chunking chunking_;
  Scratch scratch_;

  std::mutex mutex_;
  std::condition_variable queueChanged_;
  struct Job {
    c10::intrusive_ptr<TorusWork> work;
    std::string context;
    std::chrono::milliseconds timeout;
    CallSignature call;
    Body body;
  };
  std::deque<Job> queue_;
  uint64_t issued_ = 0; // sequence number of the last collective issued
  // The worker's last calls by sequence number, to describe a mismatch found a few calls late.
  std::array<std::pair<uint64_t, CallSignature>, 16> recentCalls_{};
  bool stopping_ = false;
  // Set once a collective or a send or receive fails; later calls fail fast.
  std::shared_ptr<GroupFailure> failure_ = std::make_shared<GroupFailure>();
  std::atomic<uint64_t> p2pIssued_{0}; // sends and receives issued, to number them in errors
  std::thread worker_;
};

} // namespace torus
