// ProcessGroupTorus: the c10d::Backend behind torch.distributed's "torus".
//
// It validates tensors on the calling thread (so bad arguments fail before any bytes move),
// turns each collective into a job on the group's single worker thread — jobs run in issue
// order, which is the same on every rank — and returns a TorusWork at once. Sends and receives
// go straight to the transport so that a rank's isend and irecv can never block each other.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/torus_work.h"
#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// Everything the Python shim resolved from TORUS_* variables and pg_options.
struct TorusConfig {
  std::string address = "127.0.0.1";
  int64_t chunkBytes = 512 * 1024;
  std::string allreduce = "ring";
  // 0 warn, 1 info, 2 debug.
  int logLevel = 0;
};

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

  // Queues `body` on the worker thread; the returned work completes with `outputs`.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs, std::chrono::milliseconds timeout, Body body);
  void runWorker();
  std::chrono::milliseconds timeoutOf(std::chrono::milliseconds requested) const;
  void stopWorker(bool abortPending);

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

  TorusConfig config_;
  std::string groupName_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Comm> comm_;
  Chunking chunking_;
  Scratch scratch_;

  std::mutex mutex_;
  std::condition_variable queueChanged_;
  struct Job {
    c10::intrusive_ptr<TorusWork> work;
    std::string context;
    std::chrono::milliseconds timeout;
    Body body;
  };
  std::deque<Job> queue_;
  uint64_t issued_ = 0; // sequence number of the last collective issued
  bool stopping_ = false;
  std::string failure_; // set once a collective fails; later ones fail fast
  std::thread worker_;
};

} // namespace torus
