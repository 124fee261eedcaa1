// ProcessGroupTorus: the c10d::Backend behind torch.distributed's "torus".
//
// Its entry points check their arguments on the calling thread (so bad arguments fail before
// any bytes move), describe the call, and hand it to the group's CollectiveExecutor, which runs
// collectives in issue order — the same on every rank — and returns a TorusWork at once. Sends
// and receives go straight to the transport so that a rank's isend and irecv can never block each
// other. The entry points live in one file per family: process_group_reductions.cc,
// process_group_gathers.cc, process_group_broadcasts.cc, process_group_all_to_all.cc and
// process_group_point_to_point.cc; all_reduce of sparse tensors in process_group_sparse_allreduce.cc
// and the monitored barrier in process_group_monitored_barrier.cc.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/algorithm_dispatch.h"
#include "backend/arrival_board.h"
#include "backend/dump_signal.h"
#include "backend/collective_executor.h"
#include "backend/comms_event.h"
#include "backend/device_support.h"
#include "backend/direct_ops.h"
#include "backend/reduction.h"
#include "backend/torus_config.h"
#include "backend/torus_work.h"
#include "comm/comm.h"

namespace torus {

class ProcessGroupTorus;

// What a shrink asks the group creator for: the survivors' group, created as any torus group is
// (torch_torus's creation path), over a store no other group uses.
struct ShrunkGroupRequest {
  // The old group's store under a prefix of this shrink's own, the same on every survivor.
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0; // this rank's place among the survivors
  int size = 0;
  std::chrono::milliseconds timeout{0};
  std::string groupName;
  std::vector<int64_t> globalRanks; // the survivors' ranks in the world
  std::string settings; // torch_torus.Options' settings, as torch_torus writes them (JSON)
};

class ProcessGroupTorus : public c10d::Backend {
 public:
  using GroupCreator = std::function<c10::intrusive_ptr<ProcessGroupTorus>(const ShrunkGroupRequest&)>;
  // The creator shrink() calls; torch_torus registers it once, at import.
  static void setGroupCreator(GroupCreator creator);

  ProcessGroupTorus(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    std::chrono::milliseconds timeout, TorusConfig config, std::string groupName);
  ~ProcessGroupTorus() override;

  const std::string getBackendName() const override {
    return "torus";
  }
  // Any thread may call it while others issue calls.
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_.store(timeout);
  }
  // What carries the group's bytes, as the startup log says it ("ofi: tcp on eth0 (...)").
  const std::string& transportDescription() const {
    return transportDescription_;
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
  // c10d's tensor allocation hook (FSDP2 takes its communication buffers from it): CPU tensors in
  // memory this host's peers map (shared_tensor_allocator.h); other devices' from torch.
  bool supportsTensorAlloc(c10::DeviceIndex) override {
    return true;
  }
  at::Tensor allocateTensor(long size, at::TensorOptions options) override;
  // The algorithm this group runs `collective` with for a call of `nbytes` bytes.
  Algorithm algorithmFor(const std::string& collective, uint64_t nbytes) const {
    return dispatch_.algorithmFor(collective, nbytes);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // torch.ops.torus.all_reduce_ (registered for dense CPU tensors): all_reduce in place, on the
  // calling thread with no Work when none of the group's collectives is queued or running (else
  // queued behind them and waited for); raises the collective's error.
  void allreduceHere(at::Tensor& tensor, const c10d::ReduceOp& op);
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
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
  // torch's semantics (gloo's): rank 0 waits up to the timeout for every other rank to arrive and
  // raises naming the ranks that did not (the first, or all of them with waitAllRanks); the others
  // raise when rank 0 fails. Runs on the calling thread, beside queued collectives.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // batch_isend_irecv: the sends and receives issued between the two calls are checked as they
  // come and posted together by endCoalescing (none of them when one was refused: it raises that
  // op's error), which returns one work for them all and gives the batch one record_param_comms
  // event with its totals. Collectives issued meanwhile run as usual; the batch's work covers them
  // too.
  bool supportsCoalescing() const override {
    return true;
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  // The group's ranks in the world (torch's global_ranks_in_group; empty for the world), which
  // record_param_comms events give as a start and a stride.
  void setGlobalRanks(const std::vector<int64_t>& ranks);
  // torch names a shrunk group (shrink_group) after its backend exists: torch.ops.torus reaches
  // the group by the name torch gives it.
  void setGroupUid(const std::string& pgUid) override;

  // torch.distributed.shrink_group: a new group of the ranks not in `ranksToExclude`, numbered in
  // their old order, created over the old group's store under a prefix every survivor derives
  // alike, sharing nothing with the old group. SHRINK_ABORT (1) aborts the old group's calls
  // first; SHRINK_DEFAULT (0) refuses while collectives are queued or running in a group that has
  // not failed (as NCCL's shrink does), and aborts a failed group. torch then destroys the old
  // group. The settings are the old group's (torch_torus.Options from Python: see the binding).
  bool supportsShrinking() const override {
    return true;
  }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                           const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) override;
  // shrink() with `settings` (JSON, as torch_torus writes torch_torus.Options) for the new group.
  c10::intrusive_ptr<ProcessGroupTorus> shrinkWith(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                   const std::string& settings);
  // The torch_torus.Options the group was created with (JSON), which a shrunk group inherits.
  void setSettings(std::string settings) {
    settings_ = std::move(settings);
  }
  const std::string& settings() const {
    return settings_;
  }

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;

  // Waits for queued jobs, then releases the worker thread and connections.
  void shutdown() override;
  // Fails pending and queued jobs at once and releases everything.
  void abort() override;
  // Writes the flight recorder's ring (torch_torus.dump_trace()); its path, or empty when off.
  std::string dumpTrace(const std::string& reason) {
    return executor_->dumpTrace(reason);
  }
  // Shuts down every group of this process still alive, as shutdown() does: their queued and
  // running collectives finish and their futures' callbacks run, then their worker threads end.
  // For the interpreter's exit (torch_torus's atexit hook, before Python finalizes): a worker
  // left running would drop a tensor or run a callback once Python can no longer give it the
  // GIL, which aborts the process. Called without the GIL, which the callbacks take.
  static void shutDownAll();

 private:
  // What submit takes from any collective's options.
  struct CallOptions {
    template <typename Options>
    CallOptions(const Options& opts) : timeout(opts.timeout), asyncOp(opts.asyncOp) {}
    std::chrono::milliseconds timeout;
    bool asyncOp; // false: the caller waits for the work at once (dist.*(async_op=False))
  };
  // Checks the per-call timeout and hands the call to the executor: to run on this thread when
  // the caller waits for it and it is at most TORUS_INLINE_BYTES, else queued.
  // `inSplits`, `outSplits`: all_to_all_single's split sizes, for its record_param_comms event.
  c10::intrusive_ptr<c10d::Work> submit(const CallDescription& call, std::vector<at::Tensor> outputs,
                                        std::vector<at::Tensor> inputs, CallOptions options,
                                        CollectiveExecutor::Body body, c10::ArrayRef<int64_t> inSplits = {},
                                        c10::ArrayRef<int64_t> outSplits = {});
  // The group as record_param_comms events name it.
  CommsGroup commsGroup() const;
  // Allgather of byte blocks: every rank contributes `mine` (the same length on every rank);
  // returns world-size blocks back to back.
  at::Tensor allgatherBytes(Comm& comm, const at::Tensor& mine);
  // Allgather of uneven blocks: rank q contributes counts[q] elements (`mine`, contiguous, on this
  // rank); returns every rank's block back to back in rank order, as one 1-D tensor of mine's dtype.
  at::Tensor allgatherBlocks(Comm& comm, const at::Tensor& mine, const std::vector<size_t>& counts);
  // The description and the job of a dense all_reduce of `tensor` in place (checked already).
  std::pair<CallDescription, CollectiveExecutor::Body> denseAllreduce(const at::Tensor& tensor,
                                                                      const c10d::ReduceOp& op);
  // all_reduce (SUM) of a sparse COO tensor, in place; `tensor` is sparse.
  c10::intrusive_ptr<c10d::Work> allreduceSparse(at::Tensor& tensor, const c10d::AllreduceOptions& opts);
  // Reduce-scatters `buffer` (prepared by `reduction`) in `blocks` and finishes this rank's
  // block into `output`; on the host, or on `device` (null for CPU tensors).
  void reduceScatterInto(Algorithm algorithm, Comm& comm, DeviceCall* device, at::Tensor& buffer,
                         const Blocks& blocks, const Reduction& reduction, at::Tensor& output);
  // Allreduces `buffer` (contiguous, prepared by `reduction`) in place with `algorithm`, on the
  // host, or on `device` by the device form of it (collectives/device/).
  void allreduceBuffer(Algorithm algorithm, Comm& comm, DeviceCall* device, at::Tensor& buffer,
                       const Reduction& reduction);
  // Debug log: the device route a call on device tensors took in place of `algorithm`.
  void logDeviceRoute(Algorithm algorithm, const DeviceRoutes& routes) const;
  // Allgathers `buffer` (contiguous) in `blocks` in place, on the host or on `device`.
  void allgatherBuffer(Algorithm algorithm, Comm& comm, DeviceCall* device, at::Tensor& buffer,
                       const Blocks& blocks);
  // A send or receive posted to the transport, as a work. `batched`: one of a batch, which
  // endCoalescing gives the record_param_comms event.
  c10::intrusive_ptr<c10d::Work> postPointToPoint(c10d::OpType type, const char* title, int peer, int tag,
                                                  at::Tensor& tensor, const std::string& what, bool batched);
  using PostP2P = std::function<c10::intrusive_ptr<c10d::Work>(bool batched)>;
  // Checks a send or receive of `tensor` (`check` raises) and posts it; in a batch, only checks it
  // and keeps `post` for endCoalescing.
  c10::intrusive_ptr<c10d::Work> issuePointToPoint(c10d::OpType type, const at::Tensor& tensor,
                                                   const std::function<void()>& check, PostP2P post);
  // "torus:send to rank 2 tag 0, p2p #3 (rank 0, group '5')" for the call numbered `number`.
  std::string p2pContext(const std::string& what, uint64_t number);
  // Ends the executor (shutdown, abort, shutDownAll, the destructor): one thread at a time.
  void stopExecutor(bool abortPending);

  TorusConfig config_;
  // The store the group was created over (scoped to its incarnation), for shrink().
  c10::intrusive_ptr<c10d::Store> store_;
  std::string settings_;
  std::atomic<uint64_t> shrinks_{0}; // shrinks asked of this group, each under a store prefix of its own
  std::string transportDescription_;
  std::string groupName_;
  std::atomic<std::chrono::milliseconds> timeout_;
  AlgorithmDispatch dispatch_;
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<TrafficCounters> traffic_;
  std::unique_ptr<Comm> comm_;
  // The device side of calls on CUDA tensors.
  std::unique_ptr<DeviceSupport> devices_;
  // Set once a collective or a send or receive fails; later calls fail fast.
  std::shared_ptr<GroupFailure> failure_ = std::make_shared<GroupFailure>();
  std::shared_ptr<FlightRecorder> recorder_;
  // Asks the other ranks to dump when this one fails, and dumps when another asks.
  std::shared_ptr<DumpSignal> dumps_;
  std::unique_ptr<CollectiveExecutor> executor_;
  std::mutex stopMutex_;
  // The process that created the group: a child forked since has its memory but not its threads.
  const pid_t process_;
  std::atomic<uint64_t> p2pIssued_{0}; // sends and receives issued, to number them in errors
  // Where the group's ranks lie in the world, for record_param_comms events.
  int globalRankStart_ = 0;
  int globalRankStride_ = 1;
  std::vector<int64_t> globalRanks_; // empty for the world
  // The sends and receives between startCoalescing and endCoalescing, checked, in issue order.
  struct P2PBatch {
    std::vector<PostP2P> posts;
    std::vector<at::Tensor> sent;
    std::vector<at::Tensor> received;
    std::exception_ptr refused; // the first op refused: endCoalescing raises it and posts nothing
    std::vector<c10::intrusive_ptr<c10d::Work>> collectives; // issued meanwhile, run as usual
  };
  std::mutex batchMutex_;
  std::optional<P2PBatch> batch_;
  std::atomic<bool> batching_{false}; // batch_ is open: a collective's check without the lock
  std::atomic<uint64_t> monitoredBarriers_{0}; // monitored barriers called, each with tags of its own
  // torch.ops.torus's way to this group; released first when the group goes.
  std::unique_ptr<DirectRegistration> direct_;
};

} // namespace torus
