#include "backend/process_group_torus.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <numeric>
#include <set>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/log.h"
#include "backend/process_ending.h"
#include "backend/shared_tensor_allocator.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"
#include "backend/transport_factory.h"
#include "transport/shm/shared_tensor_arena.h"

namespace torus {

namespace {

// The groups alive in this process, for ProcessGroupTorus::shutDownAll.
struct LiveGroups {
  std::mutex mutex;
  std::condition_variable changed;
  std::set<ProcessGroupTorus*> groups;
  // The group shutDownAll is stopping, whose destructor waits until it has.
  ProcessGroupTorus* stopping = nullptr;
};

// Never destroyed: a group may outlive static destructors.
LiveGroups& liveGroups() {
  static auto* live = new LiveGroups();
  return *live;
}

// torch.distributed's shrink flags (SHRINK_DEFAULT, SHRINK_ABORT).
constexpr int kShrinkDefault = 0;
constexpr int kShrinkAbort = 1;

// The creator shrink() calls (torch_torus's); never destroyed, as liveGroups.
struct RegisteredCreator {
  std::mutex mutex;
  ProcessGroupTorus::GroupCreator creator;
};

RegisteredCreator& registeredCreator() {
  static auto* registered = new RegisteredCreator();
  return *registered;
}

} // namespace

ProcessGroupTorus::ProcessGroupTorus(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                     std::chrono::milliseconds timeout, TorusConfig config, std::string groupName)
    : c10d::Backend(rank, size),
      config_(std::move(config)),
      store_(store),
      groupName_(std::move(groupName)),
      timeout_(timeout),
      dispatch_(config_, size),
      process_(::getpid()) {
  GroupTransport group = buildTransport(store, rank, size, timeout, config_, groupName_);
  transport_ = std::move(group.transport);
  transportDescription_ = group.description;
  std::vector<int> members(static_cast<size_t>(size));
  std::iota(members.begin(), members.end(), 0);
  traffic_ = std::make_shared<TrafficCounters>(std::move(group.sameHost));
  comm_ = std::make_unique<Comm>(transport_, std::move(members), rank, traffic_);
  const SharedMemory* shm = comm_->sharedMemory();
  dispatch_.setSharedMemory(shm != nullptr, shm != nullptr && shm->singleCopy());
  DeviceOptions device;
  device.rank = rank;
  device.hosts = config_.hosts;
  device.logLevel = config_.logLevel;
  device.stallBound = std::chrono::milliseconds(config_.deviceStallMs);
  device.hostDevice = config_.hostDevice;
  devices_ = DeviceSupport::create(device);
  recorder_ = std::make_shared<FlightRecorder>(config_.traceBuffer, config_.traceDir, rank, size, groupName_);
  dumps_ = std::make_shared<DumpSignal>(store, rank, size, recorder_);
  executor_ = std::make_unique<CollectiveExecutor>(rank, size, groupName_, config_.logLevel, device.stallBound,
                                                   transport_, *comm_,
                                                   ArrivalBoard::create(store, rank, size), dumps_,
                                                   failure_, recorder_);
  direct_ = std::make_unique<DirectRegistration>(groupName_, this);
  if (config_.logLevel >= 1 && rank == 0) {
    const std::string standIns = dispatch_.standIns();
    logLine(rank, "group '" + groupName_ + "' ready: " + std::to_string(size) + " ranks over " + transportDescription_ +
                      ", chunk " + std::to_string(config_.chunkBytes) + " bytes" +
                      (standIns.empty() ? "" : "; " + standIns));
  }
  SharedTensorArena::instance().attachGroup(this, config_.sharedTensorCache);
  LiveGroups& live = liveGroups();
  std::lock_guard<std::mutex> lock(live.mutex);
  live.groups.insert(this);
}

at::Tensor ProcessGroupTorus::allocateTensor(long size, at::TensorOptions options) {
  return allocateSharedTensor(size, options);
}

ProcessGroupTorus::~ProcessGroupTorus() {
  {
    LiveGroups& live = liveGroups();
    std::unique_lock<std::mutex> lock(live.mutex);
    live.groups.erase(this);
    live.changed.wait(lock, [&] { return live.stopping != this; });
  }
  direct_.reset();
  stopExecutor(false);
  SharedTensorArena::instance().detachGroup(this); // a forked child's copy: no such group there
}

void ProcessGroupTorus::shutDownAll() {
  LiveGroups& live = liveGroups();
  std::unique_lock<std::mutex> lock(live.mutex);
  for (;;) {
    const auto own = std::find_if(live.groups.begin(), live.groups.end(),
                                  [](const ProcessGroupTorus* group) { return group->process_ == ::getpid(); });
    if (own == live.groups.end()) {
      // From here on Python ends daemon threads that take the GIL: none returns to it from torus.
      markProcessEnding();
      return;
    }
    ProcessGroupTorus* group = *own;
    live.groups.erase(own);
    live.stopping = group;
    lock.unlock();
    group->stopExecutor(false);
    lock.lock();
    live.stopping = nullptr;
    live.changed.notify_all();
  }
}

void ProcessGroupTorus::stopExecutor(bool abortPending) {
  std::lock_guard<std::mutex> lock(stopMutex_);
  executor_->stop(abortPending);
}

CommsGroup ProcessGroupTorus::commsGroup() const {
  // torch names the group after creating it (ProcessGroup._set_group_name), with the name it
  // was created under.
  const std::string& name = getGroupUid();
  return CommsGroup{name.empty() ? groupName_ : name, getGroupDesc(), rank_, size_, globalRankStart_,
                    globalRankStride_};
}

void ProcessGroupTorus::setGlobalRanks(const std::vector<int64_t>& ranks) {
  globalRanks_ = ranks;
  // As ProcessGroupNCCL reads global_ranks_in_group.
  globalRankStart_ = ranks.empty() ? 0 : static_cast<int>(ranks[0]);
  if (ranks.size() < 2) {
    globalRankStride_ = ranks.empty() ? 1 : 0;
    return;
  }
  const int64_t stride = ranks[1] - ranks[0];
  globalRankStride_ = static_cast<int>(stride);
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] != ranks[0] + static_cast<int64_t>(i) * stride) {
      globalRankStride_ = -1;
      return;
    }
  }
}

void ProcessGroupTorus::setGroupUid(const std::string& pgUid) {
  c10d::Backend::setGroupUid(pgUid);
  if (pgUid != groupName_) {
    direct_ = std::make_unique<DirectRegistration>(pgUid, this);
  }
}

void ProcessGroupTorus::setGroupCreator(GroupCreator creator) {
  RegisteredCreator& registered = registeredCreator();
  std::lock_guard<std::mutex> lock(registered.mutex);
  registered.creator = std::move(creator);
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupTorus::shrink(
    const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
    const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) {
  TORUS_CHECK_ARG(!optsOverride, "shrink's options for a torus group are torch_torus.Options, given from Python; got ",
                  "c10d options for backend '", optsOverride ? optsOverride->backend : "", "'");
  return shrinkWith(ranksToExclude, shrinkFlags, settings_);
}

c10::intrusive_ptr<ProcessGroupTorus> ProcessGroupTorus::shrinkWith(const std::vector<int64_t>& ranksToExclude,
                                                                    int shrinkFlags, const std::string& settings) {
  const std::string what = "cannot shrink group '" + groupName_ + "' (rank " + std::to_string(rank_) + " of " +
                           std::to_string(size_) + "): ";
  TORUS_CHECK_ARG(shrinkFlags == kShrinkDefault || shrinkFlags == kShrinkAbort, what, "shrink_flags ", shrinkFlags,
                  " is neither SHRINK_DEFAULT (0) nor SHRINK_ABORT (1)");
  TORUS_CHECK_ARG(!ranksToExclude.empty(), what, "no rank to exclude");
  std::vector<bool> excluded(static_cast<size_t>(size_), false);
  for (const int64_t r : ranksToExclude) {
    TORUS_CHECK_ARG(r >= 0 && r < size_, what, "rank ", r, " to exclude is not in the group (0 to ", size_ - 1, ")");
    TORUS_CHECK_ARG(!excluded[static_cast<size_t>(r)], what, "rank ", r, " is listed twice");
    excluded[static_cast<size_t>(r)] = true;
  }
  TORUS_CHECK_ARG(!excluded[static_cast<size_t>(rank_)], what,
                  "this rank is among the ranks to exclude; only the ranks that remain shrink the group");
  ShrunkGroupRequest request;
  std::vector<int64_t> world = globalRanks_;
  if (world.empty()) {
    world.resize(static_cast<size_t>(size_));
    std::iota(world.begin(), world.end(), 0);
  }
  std::string without;
  for (int r = 0; r < size_; ++r) {
    if (excluded[static_cast<size_t>(r)]) {
      without += (without.empty() ? "" : ",") + std::to_string(r);
      continue;
    }
    if (r == rank_) {
      request.rank = static_cast<int>(request.globalRanks.size());
    }
    request.globalRanks.push_back(world[static_cast<size_t>(r)]);
  }
  request.size = static_cast<int>(request.globalRanks.size());
  if (shrinkFlags == kShrinkAbort || failure_->failed()) {
    // Bounded: nothing on abort's way waits for a peer or the store.
    abort();
  } else {
    TORUS_CHECK(executor_->idle(), what,
                "collectives are queued or running in it; wait for them, or pass shrink_flags=SHRINK_ABORT to "
                "abort them");
  }
  GroupCreator creator;
  {
    RegisteredCreator& registered = registeredCreator();
    std::lock_guard<std::mutex> lock(registered.mutex);
    creator = registered.creator;
  }
  TORUS_CHECK(creator, what, "no group creator is registered (import torch_torus)");
  // The old group's store is its incarnation's; under it, each shrink of the group has keys of its
  // own, which every survivor names alike: the n-th shrink of this group without these ranks.
  const std::string shrink = std::to_string(shrinks_.fetch_add(1));
  request.store = c10::make_intrusive<c10d::PrefixStore>("shrink/" + shrink + "/without/" + without, store_);
  request.timeout = timeout_.load();
  request.groupName = groupName_ + ":shrunk" + shrink;
  request.settings = settings;
  if (config_.logLevel >= 1 && request.rank == 0) {
    logLine(rank_, "group '" + groupName_ + "' shrinks to " + std::to_string(request.size) + " ranks, without rank(s) " +
                       without);
  }
  return creator(request);
}

uint64_t ProcessGroupTorus::getSequenceNumberForGroup() {
  return executor_->issued();
}

void ProcessGroupTorus::shutdown() {
  stopExecutor(false);
}

void ProcessGroupTorus::abort() {
  // Nothing on the way out waits on the store: abort() returns within a bounded time even when
  // the store froze.
  executor_->markAborting();
  transport_->abort("the process group was aborted");
  stopExecutor(true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::submit(const CallDescription& call, std::vector<at::Tensor> outputs,
                                                         std::vector<at::Tensor> inputs, CallOptions options,
                                                         CollectiveExecutor::Body body, c10::ArrayRef<int64_t> inSplits,
                                                         c10::ArrayRef<int64_t> outSplits) {
  checkTimeout(options.timeout, collectiveName(call.type));
  CommsEvent event;
  if (event.active()) {
    event.begin(commsGroup(),
                describeCollective(call.type, call.dtype, inputs, outputs, size_,
                                   static_cast<int64_t>(executor_->issued()) + 1, options.asyncOp, inSplits, outSplits),
                inputs, outputs);
  }
  std::shared_ptr<DeviceCall> device = devices_->begin(outputs, inputs, collectiveName(call.type));
  const bool mayRunHere = !options.asyncOp &&
                          std::max(totalBytesOf(outputs), totalBytesOf(inputs)) <= config_.inlineBytes;
  auto work = executor_->enqueue(call, std::move(outputs), std::move(inputs),
                                 options.timeout == c10d::kUnsetTimeout ? timeout_.load() : options.timeout,
                                 std::move(body), std::move(device), mayRunHere);
  if (batching_.load(std::memory_order_relaxed)) {
    // Issued inside a batch (torch's _coalescing_manager with a device): the batch's work covers it.
    std::lock_guard<std::mutex> lock(batchMutex_);
    if (batch_) {
      batch_->collectives.push_back(work);
    }
  }
  return work;
}

} // namespace torus
