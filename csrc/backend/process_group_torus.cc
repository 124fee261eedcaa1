#include "backend/process_group_torus.h"

#include <numeric>
#include <sstream>
#include <utility>

#include <ATen/MemoryOverlap.h>
#include <torch/csrc/distributed/c10d/exception.h>

#include "backend/log.h"
#include "collectives/alltoallv_pairwise.h"
#include "collectives/barrier_dissemination.h"
#include "collectives/broadcast_binomial.h"
#include "collectives/broadcast_chain.h"
#include "collectives/direct_allgather.h"
#include "collectives/direct_reduce_scatter.h"
#include "collectives/gather_direct.h"
#include "collectives/reduce_binomial.h"
#include "collectives/ring_allgather.h"
#include "collectives/ring_reduce_scatter.h"
#include "collectives/scatter_direct.h"
#include "transport/hybrid_transport.h"

namespace torus {

namespace {

class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto value = store_->get(key);
    return std::string(value.begin(), value.end());
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

DataType toDataType(at::ScalarType type, const std::string& what) {
  switch (type) {
    case at::kFloat:
      return DataType::kFloat32;
    case at::kDouble:
      return DataType::kFloat64;
    case at::kHalf:
      return DataType::kFloat16;
    case at::kBFloat16:
      return DataType::kBFloat16;
    case at::kChar:
      return DataType::kInt8;
    case at::kShort:
      return DataType::kInt16;
    case at::kInt:
      return DataType::kInt32;
    case at::kLong:
      return DataType::kInt64;
    case at::kByte:
      return DataType::kUInt8;
    case at::kBool:
      return DataType::kBool;
    default:
      TORCH_CHECK(false, "torus: ", what, " has dtype ", type,
                  ", which is not supported (supported: float32, float64, float16, bfloat16, int8, int16, int32, "
                  "int64, uint8, bool)");
  }
}

// Checks what every collective needs of a tensor; `what` names it in the error as torch.distributed
// names the argument, e.g. "all_gather tensor_list[3]".
void checkTensor(const at::Tensor& tensor, const std::string& what) {
  TORCH_CHECK(tensor.defined(), "torus: ", what, " is undefined");
  TORCH_CHECK(!tensor.is_cuda(), "torus: ", what,
              " is a CUDA tensor; CUDA tensors are not supported yet by the torus backend "
              "(use a device map such as backend=\"cpu:torus,cuda:nccl\")");
  TORCH_CHECK(tensor.device().is_cpu(), "torus: ", what, " is on device ", tensor.device(),
              "; only CPU tensors are supported");
  TORCH_CHECK(tensor.layout() == at::kStrided, "torus: ", what, " has layout ", tensor.layout(),
              "; only dense (strided) tensors are supported");
  toDataType(tensor.scalar_type(), what);
}

// A tensor the collective writes into: checkTensor, and no two of its elements may share memory
// (an expand()ed tensor): writing the result there fails or is undefined, and it would fail only
// after the bytes had moved.
void checkOutput(const at::Tensor& tensor, const std::string& what) {
  checkTensor(tensor, what);
  TORCH_CHECK_VALUE(at::has_internal_overlap(tensor) != at::MemOverlap::Yes, "torus: ", what,
                    " is an output, but several of its elements share memory (strides ", tensor.strides(),
                    ", e.g. from expand()); pass a tensor whose elements are distinct, such as a clone()");
}

void checkSameKind(const at::Tensor& tensor, const at::Tensor& reference, const std::string& what,
                   const std::string& referenceName, bool output) {
  if (output) {
    checkOutput(tensor, what);
  } else {
    checkTensor(tensor, what);
  }
  TORCH_CHECK_VALUE(tensor.scalar_type() == reference.scalar_type(), "torus: ", what, " has dtype ",
                    tensor.scalar_type(), " but ", referenceName, " has dtype ", reference.scalar_type());
  TORCH_CHECK_VALUE(tensor.numel() == reference.numel(), "torus: ", what, " has ", tensor.numel(),
                    " elements but ", referenceName, " has ", reference.numel());
}

// `argument` is torch.distributed's name for the root: "src" (broadcast, scatter) or "dst".
void checkRoot(int64_t root, int size, const char* collective, const char* argument) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "torus: ", collective, " ", argument, "=", root,
                    " (the root rank) is out of range: the group has ", size, " ranks, 0 to ", size - 1);
}

void checkSingle(size_t count, const char* what) {
  TORCH_CHECK_VALUE(count == 1, "torus: ", what, " takes exactly one tensor, got ", count);
}

void checkListLength(size_t length, int size, const std::string& what) {
  TORCH_CHECK_VALUE(length == static_cast<size_t>(size), "torus: ", what, " has ", length,
                    " tensors but the group has ", size, " ranks; it needs one per rank");
}

// A per-call timeout (BarrierOptions.timeout and the like): unset, or positive. Zero or a negative
// one would expire before the first byte arrives and leave the group failed.
void checkTimeout(std::chrono::milliseconds timeout, const char* collective) {
  TORCH_CHECK_VALUE(timeout == c10d::kUnsetTimeout || timeout.count() > 0, "torus: ", collective,
                    " timeout must be positive (or unset, for the group's timeout), got ", timeout.count(), " ms");
}

std::string indexed(const std::string& name, size_t i) {
  return name + "[" + std::to_string(i) + "]";
}

size_t bytesOf(const at::Tensor& tensor) {
  return static_cast<size_t>(tensor.numel()) * tensor.element_size();
}

size_t totalBytesOf(const std::vector<at::Tensor>& tensors) {
  size_t total = 0;
  for (const auto& t : tensors) {
    total += bytesOf(t);
  }
  return total;
}

at::Tensor contiguousBuffer(const at::Tensor& tensor) {
  return tensor.is_contiguous() ? tensor : tensor.contiguous();
}

void writeBack(at::Tensor& tensor, const at::Tensor& buffer) {
  if (!tensor.is_same(buffer)) {
    tensor.copy_(buffer.view(tensor.sizes()));
  }
}

Blocks blocksOfCounts(const std::vector<size_t>& counts) {
  Blocks blocks;
  size_t offset = 0;
  for (size_t count : counts) {
    blocks.offsets.push_back(offset);
    blocks.counts.push_back(count);
    offset += count;
  }
  return blocks;
}

// The tensors' bytes back to back, as one uint8 tensor.
at::Tensor packBytes(const std::vector<at::Tensor>& tensors, int64_t extraBlocks = 1) {
  int64_t total = 0;
  for (const auto& t : tensors) {
    total += static_cast<int64_t>(bytesOf(t));
  }
  auto packed = at::empty({total * extraBlocks}, at::kByte);
  int64_t offset = 0;
  for (const auto& t : tensors) {
    auto n = static_cast<int64_t>(bytesOf(t));
    if (n > 0) {
      std::memcpy(static_cast<char*>(packed.data_ptr()) + offset, contiguousBuffer(t).data_ptr(), n);
    }
    offset += n;
  }
  return packed;
}

// Copies `bytes` (a uint8 view) into `tensor`, whatever its dtype and strides.
void unpackBytes(at::Tensor& tensor, const at::Tensor& bytes) {
  if (tensor.numel() == 0) {
    return;
  }
  auto view = bytes.view(tensor.scalar_type()).view(tensor.sizes());
  tensor.copy_(view);
}

const char* reduceOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNUSED";
  }
}

constexpr std::pair<Algorithm, const char*> kAlgorithmNames[] = {
    {Algorithm::kRing, "ring"},
    {Algorithm::kTorus, "torus"},
    {Algorithm::kDirect, "direct"},
    {Algorithm::kRecursiveDoubling, "recursive_doubling"},
    {Algorithm::kRabenseifner, "rabenseifner"},
    {Algorithm::kOneShot, "one_shot"},
    {Algorithm::kTwoShot, "two_shot"},
    {Algorithm::kBinomial, "binomial"},
    {Algorithm::kChain, "chain"},
};

// What each collective can run, its fallback first.
const std::map<std::string, std::vector<Algorithm>>& algorithmsByCollective() {
  static const std::map<std::string, std::vector<Algorithm>> table = {
      {"allreduce",
       {Algorithm::kRing, Algorithm::kTorus, Algorithm::kDirect, Algorithm::kRecursiveDoubling,
        Algorithm::kRabenseifner, Algorithm::kOneShot, Algorithm::kTwoShot}},
      {"allgather", {Algorithm::kRing, Algorithm::kDirect}},
      {"reduce_scatter", {Algorithm::kRing, Algorithm::kDirect}},
      {"broadcast", {Algorithm::kBinomial, Algorithm::kChain}},
  };
  return table;
}

Algorithm parseAlgorithm(const std::string& collective, const std::string& name) {
  const auto& allowed = algorithmsByCollective().at(collective);
  for (const auto& entry : kAlgorithmNames) {
    if (name == entry.second && std::find(allowed.begin(), allowed.end(), entry.first) != allowed.end()) {
      return entry.first;
    }
  }
  TORCH_CHECK_VALUE(false, "torus: ", collective, " has no algorithm named '", name, "'");
}

AllreduceFn allreduceFunction(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kDirect:
      return direct_allreduce;
    case Algorithm::kRecursiveDoubling:
      return recursive_doubling_allreduce;
    case Algorithm::kRabenseifner:
      return rabenseifner_allreduce;
    case Algorithm::kOneShot:
      return one_shot_allreduce;
    case Algorithm::kTwoShot:
      return two_shot_allreduce;
    default:
      return ring_allreduce;
  }
}

} // namespace

const char* algorithmName(Algorithm algorithm) {
  for (const auto& entry : kAlgorithmNames) {
    if (entry.first == algorithm) {
      return entry.second;
    }
  }
  return "unknown";
}

namespace {

// What every rank must agree on about one call: its kind, dtype, reduction, root, algorithm and
// size (`nbytes` as the collective counts it: the same on every rank of a correct program).
CallSignature callOf(c10d::OpType type, at::ScalarType dtype, uint64_t nbytes,
                     std::optional<c10d::ReduceOp::RedOpType> op = std::nullopt, int root = -1,
                     std::optional<Algorithm> algorithm = std::nullopt) {
  CallSignature call;
  call.kind = static_cast<uint8_t>(static_cast<int>(type) + 1);
  call.dtype = static_cast<uint8_t>(dtype);
  call.op = op ? static_cast<uint8_t>(*op + 1) : 0;
  call.algorithm = algorithm ? static_cast<uint8_t>(static_cast<int>(*algorithm) + 1) : 0;
  call.root = root;
  call.nbytes = nbytes;
  return call;
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

const char* reduceOpName(uint8_t op) {
  static const char* const names[] = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"};
  return op < std::size(names) ? names[op] : "an unknown reduction";
}

// "all_reduce of 4000 bytes float32 (sum, ring)"
std::string describeCall(const CallSignature& call) {
  std::ostringstream out;
  out << collectiveName(static_cast<c10d::OpType>(call.kind - 1)) << " of " << call.nbytes << " bytes "
      << c10::getDtypeNames(static_cast<at::ScalarType>(call.dtype)).first;
  std::vector<std::string> details;
  if (call.op != 0) {
    details.push_back(reduceOpName(call.op - 1));
  }
  if (call.root >= 0) {
    details.push_back("root " + std::to_string(call.root));
  }
  if (call.algorithm != 0) {
    details.push_back(algorithmName(static_cast<Algorithm>(call.algorithm - 1)));
  }
  for (size_t i = 0; i < details.size(); ++i) {
    out << (i == 0 ? " (" : ", ") << details[i] << (i + 1 == details.size() ? ")" : "");
  }
  return out.str();
}

} // namespace

ProcessGroupTorus::ProcessGroupTorus(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                     std::chrono::milliseconds timeout, TorusConfig config, std::string groupName)
    : c10d::Backend(rank, size), config_(std::move(config)), groupName_(std::move(groupName)), timeout_(timeout) {
  TORCH_CHECK_VALUE(config_.chunkBytes > 0, "torus: chunk size must be positive, got ", config_.chunkBytes);
  chunking_.chunkBytes = static_cast<size_t>(config_.chunkBytes);
  for (const auto& entry : config_.algorithms) {
    TORCH_CHECK_VALUE(algorithmsByCollective().count(entry.first), "torus: unknown collective '", entry.first,
                      "' in the algorithm table");
    for (const auto& rule : entry.second) {
      TORCH_CHECK_VALUE(rule.lo <= rule.hi, "torus: ", entry.first, " rule ", rule.algorithm, ":", rule.lo, "-",
                        rule.hi, " is reversed");
      selection_[entry.first].push_back({rule.lo, rule.hi, parseAlgorithm(entry.first, rule.algorithm)});
    }
  }
  if (!config_.torusRows.empty()) {
    size_t members = 0;
    for (const auto& row : config_.torusRows) {
      TORCH_CHECK_VALUE(row.size() == config_.torusRows[0].size(), "torus: torus grid rows differ in length");
      members += row.size();
    }
    TORCH_CHECK_VALUE(members == static_cast<size_t>(size), "torus: torus grid has ", members, " ranks, the group ",
                      size);
    grid_.rows = config_.torusRows;
  }
  const Algorithm inner = parseAlgorithm("allreduce", config_.torusInner);
  TORCH_CHECK_VALUE(inner != Algorithm::kOneShot && inner != Algorithm::kTwoShot, "torus: the torus inner algorithm ",
                    config_.torusInner, " cannot run on a torus column (it needs the whole group's shared memory)");
  torusInner_ = allreduceFunction(inner);
  TORCH_CHECK_VALUE(config_.transport == "tcp" || config_.transport == "shm" || config_.transport == "shm+tcp",
                    "torus: unknown transport '", config_.transport, "'; expected tcp, shm or shm+tcp");
  TORCH_CHECK_VALUE(config_.hosts.empty() || config_.hosts.size() == static_cast<size_t>(size), "torus: ",
                    config_.hosts.size(), " host indices for a group of ", size, " ranks");
  std::vector<bool> sameHost(static_cast<size_t>(size), true);
  std::vector<int> hostMembers;
  for (size_t r = 0; r < config_.hosts.size(); ++r) {
    sameHost[r] = config_.hosts[r] == config_.hosts[static_cast<size_t>(rank)];
    if (sameHost[r]) {
      hostMembers.push_back(static_cast<int>(r));
    }
  }
  StoreRendezvous rendezvous(store);
  try {
    TcpOptions tcp;
    tcp.address = config_.address;
    tcp.timeout = timeout;
    if (config_.transport == "shm") {
      auto shm = std::make_shared<ShmTransport>(rank, size, rendezvous);
      sharedMemory_ = true;
      singleCopy_ = shm->singleCopy();
      transport_ = std::move(shm);
    } else if (config_.transport == "shm+tcp") {
      TORCH_CHECK_VALUE(!hostMembers.empty(), "torus: transport shm+tcp needs the ranks' hosts");
      transport_ = std::make_shared<HybridTransport>(std::make_unique<TcpTransport>(rank, size, rendezvous, tcp),
                                                     std::make_unique<ShmTransport>(rank, size, rendezvous, hostMembers),
                                                     sameHost);
    } else {
      transport_ = std::make_shared<TcpTransport>(rank, size, rendezvous, tcp);
    }
  } catch (const CommError& e) {
    C10_THROW_ERROR(DistBackendError, std::string("torus: cannot create group '") + groupName_ + "': " + e.what());
  }
  std::vector<int> members(static_cast<size_t>(size));
  std::iota(members.begin(), members.end(), 0);
  traffic_ = std::make_shared<TrafficCounters>(std::move(sameHost));
  comm_ = std::make_unique<Comm>(transport_, std::move(members), rank, traffic_);
  arrivals_ = std::make_shared<ArrivalBoard>(store, rank, size);
  worker_ = std::thread(&ProcessGroupTorus::runWorker, this);
  if (config_.logLevel >= 1 && rank == 0) {
    std::ostringstream line;
    line << "group '" << groupName_ << "' ready: " << size << " ranks over ";
    if (sharedMemory_) {
      line << "shared memory (" << (singleCopy_ ? "single-copy transfers" : "no single-copy transfers: two_shot off")
           << ")";
    } else if (config_.transport == "shm+tcp") {
      line << "shared memory inside each host, tcp between hosts (" << config_.address << ")";
    } else {
      line << "tcp (" << config_.address << ")";
    }
    line << ", chunk " << config_.chunkBytes << " bytes";
    logLine(rank, line.str());
  }
}

ProcessGroupTorus::~ProcessGroupTorus() {
  stopWorker(false);
}

uint64_t ProcessGroupTorus::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_;
}

Algorithm ProcessGroupTorus::algorithmFor(const std::string& collective, uint64_t nbytes) const {
  auto known = algorithmsByCollective().find(collective);
  TORCH_CHECK_VALUE(known != algorithmsByCollective().end(), "torus: unknown collective '", collective,
                    "'; known: allreduce, allgather, reduce_scatter, broadcast");
  auto rules = selection_.find(collective);
  if (rules != selection_.end()) {
    for (const auto& rule : rules->second) {
      if (nbytes >= rule.lo && nbytes <= rule.hi) {
        return usable(rule.algorithm, nbytes);
      }
    }
  }
  return known->second.front();
}

Algorithm ProcessGroupTorus::usable(Algorithm algorithm, uint64_t nbytes) const {
  // A torus needs a grid; a world without one (a prime size) runs the ring instead.
  if (algorithm == Algorithm::kTorus && grid_.rows.empty()) {
    return Algorithm::kRing;
  }
  // The shared-memory allreduces need the shm transport (and one_shot a message that fits its
  // slot, two_shot single-copy access); where they cannot run, the next best that can.
  if (algorithm == Algorithm::kOneShot && (!sharedMemory_ || nbytes > ShmTransport::kSlotBytes)) {
    return sharedMemory_ ? usable(Algorithm::kTwoShot, nbytes) : Algorithm::kRecursiveDoubling;
  }
  if (algorithm == Algorithm::kTwoShot && !(sharedMemory_ && singleCopy_)) {
    return Algorithm::kRing;
  }
  return algorithm;
}

const char* ProcessGroupTorus::titleOf(const char* collective, Algorithm algorithm) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, Algorithm>, std::string> titles;
  std::lock_guard<std::mutex> lock(mutex);
  auto& title = titles[{collective, algorithm}];
  if (title.empty()) {
    title = std::string(collective) + ":" + algorithmName(algorithm);
  }
  return title.c_str();
}

void ProcessGroupTorus::runAllreduce(Algorithm algorithm, Comm& comm, void* buf, size_t count,
                                     const Reducer& reducer) {
  if (algorithm == Algorithm::kTorus) {
    torus_allreduce(comm, buf, count, reducer, grid_, torusInner_, chunking_, scratch_);
  } else {
    allreduceFunction(algorithm)(comm, buf, count, reducer, chunking_, scratch_);
  }
}

void ProcessGroupTorus::runAllgather(Algorithm algorithm, Comm& comm, void* buf, const Blocks& blocks,
                                     size_t elementSize) {
  if (algorithm == Algorithm::kDirect) {
    direct_allgather(comm, buf, blocks, elementSize, chunking_);
  } else {
    ring_allgather(comm, buf, blocks, elementSize, chunking_);
  }
}

void ProcessGroupTorus::runReduceScatter(Algorithm algorithm, Comm& comm, void* buf, const Blocks& blocks,
                                         const Reducer& reducer) {
  if (algorithm == Algorithm::kDirect) {
    direct_reduce_scatter(comm, buf, blocks, reducer, chunking_, scratch_);
  } else {
    ring_reduce_scatter(comm, buf, blocks, reducer, chunking_, scratch_);
  }
}

std::chrono::milliseconds ProcessGroupTorus::timeoutOf(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? timeout_ : requested;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::enqueue(c10d::OpType type, const char* title,
                                                          std::vector<at::Tensor> outputs,
                                                          std::vector<at::Tensor> inputs,
                                                          std::chrono::milliseconds timeout, CallSignature call,
                                                          Body body) {
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_CHECK(!stopping_, "torus: ", title, " called on a process group that has been shut down or aborted");
  uint64_t seq = ++issued_;
  std::ostringstream context;
  context << title << " #" << seq << " (rank " << rank_ << " of " << size_ << ", group '" << groupName_ << "')";
  auto work =
      c10::make_intrusive<TorusWork>(rank_, type, title, std::move(outputs), seq, std::move(inputs), context.str(),
                                    arrivals_);
  queue_.push_back(Job{work, context.str(), timeoutOf(timeout), call, std::move(body)});
  lock.unlock();
  queueChanged_.notify_one();
  return work;
}

void ProcessGroupTorus::runWorker() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Spin briefly before sleeping: a caller issuing collectives back to back hands over the
      // next one within microseconds, and a condition-variable sleep would cost a wake-up.
      const auto spinUntil = Clock::now() + kSpinBeforeSleep;
      while (!stopping_ && queue_.empty() && Clock::now() < spinUntil) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
      }
      queueChanged_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      checkUsable(job.context);
    } catch (...) {
      error = std::current_exception();
    }
    if (!error) {
      const uint64_t seq = job.work->getSequencenumber();
      try {
        if (config_.logLevel >= 2) {
          logLine(rank_, job.context);
        }
        comm_->setTag(seq);
        comm_->setCall(job.call);
        comm_->setDeadline(Clock::now() + job.timeout);
        recentCalls_[seq % recentCalls_.size()] = {seq, job.call};
        arrivals_->entered(seq, job.timeout);
        job.body(*comm_);
        if (auto stray = transport_->strayMessage(seq)) {
          const auto& [callSeq, call] = recentCalls_[stray->tag % recentCalls_.size()];
          throw CommError(CommError::Kind::kMismatch, "stray message",
                          CallMismatch{stray->peer, stray->tag, callSeq == stray->tag ? call : CallSignature{},
                                       stray->call});
        }
      } catch (const CommError& e) {
        std::string what = e.what();
        if (e.kind() == CommError::Kind::kTimeout) {
          if (auto missing = arrivals_->describeMissing(seq); !missing.empty()) {
            what += "; " + missing;
          }
        }
        if (e.mismatch()) {
          const CallMismatch& mismatch = *e.mismatch();
          what = "ranks called different collectives";
          if (mismatch.tag != seq) {
            what += " at #" + std::to_string(mismatch.tag);
          }
          what += ": rank " + std::to_string(rank_) + " called " +
                  (mismatch.mine.kind != 0 ? describeCall(mismatch.mine) : std::string("another collective")) +
                  ", rank " + std::to_string(mismatch.peer) + " called " + describeCall(mismatch.theirs);
        }
        const std::string failure = job.context + ": " + what;
        failure_->record(failure);
        error = asTorchError(std::make_exception_ptr(CommError(e.kind(), what)), job.context);
        // The failed collective's other sends and receives still point into its buffers and
        // the scratch; end them all before those are freed or reused.
        transport_->abort(failure);
      } catch (...) {
        error = asTorchError(std::current_exception(), job.context);
      }
      arrivals_->left();
    }
    if (error) {
      job.work->fail(error);
    } else {
      job.work->complete();
    }
  }
}

void ProcessGroupTorus::checkUsable(const std::string& context) const {
  const std::string earlier = failure_->get();
  if (!earlier.empty()) {
    C10_THROW_ERROR(DistBackendError, context + ": the group is unusable after an earlier failure: " + earlier);
  }
}

std::string ProcessGroupTorus::p2pContext(const std::string& what) {
  std::ostringstream context;
  context << "torus:" << what << ", p2p #" << ++p2pIssued_ << " (rank " << rank_ << ", group '" << groupName_ << "')";
  return context.str();
}

void ProcessGroupTorus::stopWorker(bool abortPending) {
  std::deque<Job> abandoned;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    if (abortPending) {
      abandoned.swap(queue_);
    }
  }
  queueChanged_.notify_all();
  for (auto& job : abandoned) {
    job.work->fail(asTorchError(std::make_exception_ptr(CommError(CommError::Kind::kAborted,
                                                                  "the process group was aborted")),
                                job.context));
  }
  if (worker_.joinable()) {
    worker_.join();
  }
  arrivals_->stop();
}

void ProcessGroupTorus::shutdown() {
  stopWorker(false);
}

void ProcessGroupTorus::abort() {
  transport_->abort("the process group was aborted");
  stopWorker(true);
}

ProcessGroupTorus::Reduction ProcessGroupTorus::reductionFor(const c10d::ReduceOp& op, at::ScalarType dtype,
                                                             const char* collective) const {
  DataType dataType = toDataType(dtype, std::string(collective) + " tensor");
  const bool floating = isFloatingPoint(dataType);
  Reduction reduction;
  ReduceKind kind = ReduceKind::kSum;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      break;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(floating, "torus: ReduceOp.AVG in ", collective, " needs a floating-point tensor, got ", dtype);
      reduction.average = true;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK(floating, "torus: ReduceOp.PREMUL_SUM in ", collective, " needs a floating-point tensor, got ",
                  dtype);
      // NCCLPreMulSumSupplement: the struct's name up to torch 2.11, kept as an alias of
      // PreMulSumSupplement since; the one name that builds against both.
      auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(supplement != nullptr, "torus: ReduceOp.PREMUL_SUM in ", collective, " carries no factor");
      reduction.preScale =
          supplement->tensor_factor.defined() ? supplement->tensor_factor.item<double>() : supplement->double_factor;
      break;
    }
    case c10d::ReduceOp::PRODUCT:
      kind = ReduceKind::kProduct;
      break;
    case c10d::ReduceOp::MIN:
      kind = ReduceKind::kMin;
      break;
    case c10d::ReduceOp::MAX:
      kind = ReduceKind::kMax;
      break;
    case c10d::ReduceOp::BAND:
      kind = ReduceKind::kBand;
      break;
    case c10d::ReduceOp::BOR:
      kind = ReduceKind::kBor;
      break;
    case c10d::ReduceOp::BXOR:
      kind = ReduceKind::kBxor;
      break;
    default:
      TORCH_CHECK(false, "torus: reduce op ", reduceOpName(op.op_), " is not supported (", collective, ")");
  }
  reduction.reducer = makeReducer(dataType, kind);
  TORCH_CHECK(reduction.reducer.fn != nullptr, "torus: ReduceOp.", reduceOpName(op.op_),
              " is not supported for ", dtype, " tensors (", collective, ")");
  return reduction;
}

void ProcessGroupTorus::applyPreScale(const Reduction& reduction, at::Tensor& tensor) const {
  if (reduction.preScale != 1.0) {
    tensor.mul_(reduction.preScale);
  }
}

void ProcessGroupTorus::applyAverage(const Reduction& reduction, at::Tensor& tensor) const {
  if (reduction.average) {
    tensor.div_(size_);
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allreduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  checkSingle(tensors.size(), "all_reduce");
  checkTimeout(opts.timeout, "all_reduce");
  at::Tensor tensor = tensors[0];
  checkOutput(tensor, "all_reduce tensor");
  auto reduction = reductionFor(opts.reduceOp, tensor.scalar_type(), "all_reduce");
  const Algorithm algorithm = algorithmFor("allreduce", bytesOf(tensor));
  return enqueue(c10d::OpType::ALLREDUCE, titleOf("torus:all_reduce", algorithm), {tensor}, {tensor}, opts.timeout,
                 callOf(c10d::OpType::ALLREDUCE, tensor.scalar_type(), bytesOf(tensor), opts.reduceOp.op_, -1, algorithm),
                 [this, tensor, reduction, algorithm](Comm& comm) mutable {
                   at::Tensor buffer = contiguousBuffer(tensor);
                   applyPreScale(reduction, buffer);
                   runAllreduce(algorithm, comm, buffer.data_ptr(), static_cast<size_t>(buffer.numel()),
                                reduction.reducer);
                   applyAverage(reduction, buffer);
                   writeBack(tensor, buffer);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                      const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "torus: all_reduce_coalesced tensors is empty; it needs at least one tensor");
  checkTimeout(opts.timeout, "all_reduce_coalesced");
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkOutput(tensors[i], indexed("all_reduce_coalesced tensors", i));
    TORCH_CHECK_VALUE(tensors[i].scalar_type() == tensors[0].scalar_type(), "torus: all_reduce_coalesced tensors[", i,
                      "] has dtype ", tensors[i].scalar_type(), " but tensors[0] has ", tensors[0].scalar_type());
  }
  auto reduction = reductionFor(opts.reduceOp, tensors[0].scalar_type(), "all_reduce_coalesced");
  const size_t totalBytes = totalBytesOf(tensors);
  const Algorithm algorithm = algorithmFor("allreduce", totalBytes);
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, titleOf("torus:all_reduce_coalesced", algorithm), tensors, tensors,
                 opts.timeout,
                 callOf(c10d::OpType::ALLREDUCE_COALESCED, tensors[0].scalar_type(), totalBytes, opts.reduceOp.op_, -1,
                        algorithm),
                 [this, tensors, reduction, algorithm](Comm& comm) mutable {
                   std::vector<at::Tensor> flat;
                   for (const auto& t : tensors) {
                     flat.push_back(t.reshape({-1}));
                   }
                   at::Tensor buffer = at::cat(flat);
                   applyPreScale(reduction, buffer);
                   runAllreduce(algorithm, comm, buffer.data_ptr(), static_cast<size_t>(buffer.numel()),
                                reduction.reducer);
                   applyAverage(reduction, buffer);
                   int64_t offset = 0;
                   for (auto& t : tensors) {
                     t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
                     offset += t.numel();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::broadcast(std::vector<at::Tensor>& tensors,
                                                            const c10d::BroadcastOptions& opts) {
  checkSingle(tensors.size(), "broadcast");
  checkRoot(opts.rootRank, size_, "broadcast", "src");
  checkTimeout(opts.timeout, "broadcast");
  at::Tensor tensor = tensors[0];
  checkOutput(tensor, "broadcast tensor");
  int root = static_cast<int>(opts.rootRank);
  const Algorithm algorithm = algorithmFor("broadcast", bytesOf(tensor));
  return enqueue(c10d::OpType::BROADCAST, titleOf("torus:broadcast", algorithm), {tensor}, {tensor}, opts.timeout,
                 callOf(c10d::OpType::BROADCAST, tensor.scalar_type(), bytesOf(tensor), std::nullopt, root, algorithm),
                 [this, tensor, root, algorithm](Comm& comm) mutable {
                   at::Tensor buffer = contiguousBuffer(tensor);
                   if (algorithm == Algorithm::kChain) {
                     broadcast_chain(comm, buffer.data_ptr(), bytesOf(buffer), root, chunking_);
                   } else {
                     broadcast_binomial(comm, buffer.data_ptr(), bytesOf(buffer), root, chunking_);
                   }
                   writeBack(tensor, buffer);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::reduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::ReduceOptions& opts) {
  checkSingle(tensors.size(), "reduce");
  checkRoot(opts.rootRank, size_, "reduce", "dst");
  checkTimeout(opts.timeout, "reduce");
  at::Tensor tensor = tensors[0];
  checkOutput(tensor, "reduce tensor");
  auto reduction = reductionFor(opts.reduceOp, tensor.scalar_type(), "reduce");
  int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::REDUCE, "torus:reduce", {tensor}, {tensor}, opts.timeout,
                 callOf(c10d::OpType::REDUCE, tensor.scalar_type(), bytesOf(tensor), opts.reduceOp.op_, root),
                 [this, tensor, reduction, root](Comm& comm) mutable {
                   // Only the root's tensor is an output; the others keep their values.
                   at::Tensor buffer = comm.rank() == root ? contiguousBuffer(tensor)
                                                           : tensor.clone(at::MemoryFormat::Contiguous);
                   applyPreScale(reduction, buffer);
                   reduce_binomial(comm, buffer.data_ptr(), static_cast<size_t>(buffer.numel()), reduction.reducer,
                                   root, chunking_, scratch_);
                   if (comm.rank() == root) {
                     applyAverage(reduction, buffer);
                     writeBack(tensor, buffer);
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  checkSingle(inputs.size(), "all_gather input");
  checkSingle(outputs.size(), "all_gather output list");
  checkTimeout(opts.timeout, "all_gather");
  at::Tensor input = inputs[0];
  checkTensor(input, "all_gather tensor (the input)");
  std::vector<at::Tensor> outputList = outputs[0];
  checkListLength(outputList.size(), size_, "all_gather tensor_list (the output list)");
  for (size_t i = 0; i < outputList.size(); ++i) {
    checkSameKind(outputList[i], input, indexed("all_gather tensor_list", i), "the input tensor", true);
  }
  const Algorithm algorithm = algorithmFor("allgather", bytesOf(input) * size_);
  return enqueue(c10d::OpType::ALLGATHER, titleOf("torus:all_gather", algorithm), outputList, {input}, opts.timeout,
                 callOf(c10d::OpType::ALLGATHER, input.scalar_type(), bytesOf(input) * size_, std::nullopt, -1,
                        algorithm),
                 [this, input, outputList, algorithm](Comm& comm) mutable {
                   const size_t count = static_cast<size_t>(input.numel());
                   at::Tensor gathered = at::empty({static_cast<int64_t>(count) * size_}, input.options());
                   gathered.narrow(0, static_cast<int64_t>(count) * rank_, static_cast<int64_t>(count))
                       .copy_(input.reshape({-1}));
                   runAllgather(algorithm, comm, gathered.data_ptr(),
                                blocksOfCounts(std::vector<size_t>(static_cast<size_t>(size_), count)),
                                gathered.element_size());
                   for (int i = 0; i < size_; ++i) {
                     outputList[i].copy_(gathered.narrow(0, static_cast<int64_t>(count) * i, static_cast<int64_t>(count))
                                             .view(outputList[i].sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::AllgatherOptions& opts) {
  checkTimeout(opts.timeout, "all_gather_into_tensor");
  checkTensor(input, "all_gather_into_tensor input_tensor");
  checkOutput(output, "all_gather_into_tensor output_tensor");
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(),
                    "torus: all_gather_into_tensor output_tensor has dtype ", output.scalar_type(),
                    " but input_tensor has ", input.scalar_type());
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "torus: all_gather_into_tensor output_tensor has ",
                    output.numel(), " elements; it needs world size (", size_, ") x input_tensor's elements (",
                    input.numel(), ")");
  const Algorithm algorithm = algorithmFor("allgather", bytesOf(output));
  return enqueue(c10d::OpType::_ALLGATHER_BASE, titleOf("torus:all_gather_into_tensor", algorithm), {output}, {input},
                 opts.timeout,
                 callOf(c10d::OpType::_ALLGATHER_BASE, output.scalar_type(), bytesOf(output), std::nullopt, -1,
                        algorithm),
                 [this, input, output, algorithm](Comm& comm) mutable {
                   const size_t count = static_cast<size_t>(input.numel());
                   at::Tensor buffer = output.is_contiguous() ? output : at::empty({output.numel()}, output.options());
                   buffer.view({-1})
                       .narrow(0, static_cast<int64_t>(count) * rank_, static_cast<int64_t>(count))
                       .copy_(input.reshape({-1}));
                   runAllgather(algorithm, comm, buffer.data_ptr(),
                                blocksOfCounts(std::vector<size_t>(static_cast<size_t>(size_), count)),
                                buffer.element_size());
                   writeBack(output, buffer);
                 });
}

at::Tensor ProcessGroupTorus::allgatherBytes(Comm& comm, const at::Tensor& mine) {
  const size_t blockBytes = static_cast<size_t>(mine.numel());
  const int n = comm.size();
  at::Tensor gathered = at::empty({static_cast<int64_t>(blockBytes) * n}, at::kByte);
  if (blockBytes > 0) {
    std::memcpy(static_cast<char*>(gathered.data_ptr()) + blockBytes * comm.rank(), mine.data_ptr(), blockBytes);
  }
  runAllgather(algorithmFor("allgather", blockBytes * n), comm, gathered.data_ptr(),
               blocksOfCounts(std::vector<size_t>(static_cast<size_t>(n), blockBytes)), 1);
  return gathered;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                      std::vector<at::Tensor>& inputs,
                                                                      const c10d::AllgatherOptions& opts) {
  checkTimeout(opts.timeout, "all_gather_coalesced");
  TORCH_CHECK_VALUE(outputLists.size() == static_cast<size_t>(size_), "torus: all_gather_coalesced ",
                    "output_tensor_lists has ", outputLists.size(), " lists but the group has ", size_,
                    " ranks; it needs one per rank");
  for (size_t j = 0; j < inputs.size(); ++j) {
    checkTensor(inputs[j], indexed("all_gather_coalesced input_tensor_list", j));
  }
  std::vector<at::Tensor> flatOutputs;
  for (size_t i = 0; i < outputLists.size(); ++i) {
    TORCH_CHECK_VALUE(outputLists[i].size() == inputs.size(), "torus: all_gather_coalesced output_tensor_lists[", i,
                      "] has ", outputLists[i].size(), " tensors but input_tensor_list has ", inputs.size());
    for (size_t j = 0; j < inputs.size(); ++j) {
      checkSameKind(outputLists[i][j], inputs[j],
                    "all_gather_coalesced output_tensor_lists[" + std::to_string(i) + "][" + std::to_string(j) + "]",
                    indexed("input_tensor_list", j), true);
      flatOutputs.push_back(outputLists[i][j]);
    }
  }
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "torus:all_gather_coalesced", flatOutputs, inputs, opts.timeout,
                 callOf(c10d::OpType::ALLGATHER_COALESCED, at::kByte, totalBytesOf(inputs)), [this, inputs, outputLists](Comm& comm) mutable {
                   at::Tensor gathered = allgatherBytes(comm, packBytes(inputs));
                   const int64_t blockBytes = gathered.numel() / size_;
                   for (int i = 0; i < size_; ++i) {
                     int64_t offset = blockBytes * i;
                     for (auto& out : outputLists[i]) {
                       auto n = static_cast<int64_t>(bytesOf(out));
                       unpackBytes(out, gathered.narrow(0, offset, n));
                       offset += n;
                     }
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                  std::vector<at::Tensor>& inputs,
                                                                                  const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "torus: all_gather_into_tensor (coalesced) has ", outputs.size(),
                    " outputs but ", inputs.size(), " inputs");
  checkTimeout(opts.timeout, "all_gather_into_tensor");
  for (size_t j = 0; j < inputs.size(); ++j) {
    checkTensor(inputs[j], "all_gather_into_tensor (coalesced) input " + std::to_string(j));
    checkOutput(outputs[j], "all_gather_into_tensor (coalesced) output " + std::to_string(j));
    TORCH_CHECK_VALUE(outputs[j].scalar_type() == inputs[j].scalar_type() &&
                          outputs[j].numel() == inputs[j].numel() * size_,
                      "torus: all_gather_into_tensor (coalesced) output ", j, " has dtype ", outputs[j].scalar_type(),
                      " and ", outputs[j].numel(), " elements; it needs input ", j, "'s dtype (",
                      inputs[j].scalar_type(), ") and world size (", size_, ") x its elements (", inputs[j].numel(), ")");
  }
  return enqueue(c10d::OpType::COALESCED, "torus:all_gather_into_tensor_coalesced", outputs, inputs, opts.timeout,
                 callOf(c10d::OpType::COALESCED, at::kByte, totalBytesOf(inputs)), [this, inputs, outputs](Comm& comm) mutable {
                   at::Tensor gathered = allgatherBytes(comm, packBytes(inputs));
                   const int64_t blockBytes = gathered.numel() / size_;
                   int64_t offset = 0;
                   for (size_t j = 0; j < inputs.size(); ++j) {
                     const auto n = static_cast<int64_t>(bytesOf(inputs[j]));
                     std::vector<at::Tensor> pieces;
                     for (int i = 0; i < size_; ++i) {
                       pieces.push_back(gathered.narrow(0, blockBytes * i + offset, n));
                     }
                     unpackBytes(outputs[j], at::cat(pieces));
                     offset += n;
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::GatherOptions& opts) {
  checkRoot(opts.rootRank, size_, "gather", "dst");
  checkTimeout(opts.timeout, "gather");
  checkSingle(inputs.size(), "gather input");
  at::Tensor input = inputs[0];
  checkTensor(input, "gather tensor (the input)");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outputList;
  if (rank_ == root) {
    checkSingle(outputs.size(), "gather output list");
    outputList = outputs[0];
    checkListLength(outputList.size(), size_, "gather gather_list");
    for (size_t i = 0; i < outputList.size(); ++i) {
      checkSameKind(outputList[i], input, indexed("gather gather_list", i), "the input tensor", true);
    }
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "torus: gather gather_list must ",
                      "be empty on ranks other than dst (rank ", rank_, " is not dst=", root, ")");
  }
  return enqueue(c10d::OpType::GATHER, "torus:gather", outputList, {input}, opts.timeout,
                 callOf(c10d::OpType::GATHER, input.scalar_type(), bytesOf(input), std::nullopt, root), [this, input, outputList, root](Comm& comm) mutable {
                   at::Tensor in = contiguousBuffer(input);
                   const size_t nbytes = bytesOf(in);
                   at::Tensor gathered;
                   if (comm.rank() == root) {
                     gathered = at::empty({static_cast<int64_t>(nbytes) * size_}, at::kByte);
                   }
                   gather_direct(comm, in.data_ptr(), nbytes, root == comm.rank() ? gathered.data_ptr() : nullptr,
                                 root);
                   for (int i = 0; i < static_cast<int>(outputList.size()); ++i) {
                     unpackBytes(outputList[i], gathered.narrow(0, static_cast<int64_t>(nbytes) * i,
                                                                static_cast<int64_t>(nbytes)));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ScatterOptions& opts) {
  checkRoot(opts.rootRank, size_, "scatter", "src");
  checkTimeout(opts.timeout, "scatter");
  checkSingle(outputs.size(), "scatter output");
  at::Tensor output = outputs[0];
  checkOutput(output, "scatter tensor (the output)");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> inputList;
  if (rank_ == root) {
    checkSingle(inputs.size(), "scatter input list");
    inputList = inputs[0];
    checkListLength(inputList.size(), size_, "scatter scatter_list");
    for (size_t i = 0; i < inputList.size(); ++i) {
      checkSameKind(inputList[i], output, indexed("scatter scatter_list", i), "the output tensor", false);
    }
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "torus: scatter scatter_list must ",
                      "be empty on ranks other than src (rank ", rank_, " is not src=", root, ")");
  }
  return enqueue(c10d::OpType::SCATTER, "torus:scatter", {output}, inputList, opts.timeout,
                 callOf(c10d::OpType::SCATTER, output.scalar_type(), bytesOf(output), std::nullopt, root), [this, output, inputList, root](Comm& comm) mutable {
                   at::Tensor packed = comm.rank() == root ? packBytes(inputList) : at::Tensor();
                   at::Tensor buffer = contiguousBuffer(output);
                   scatter_direct(comm, packed.defined() ? packed.data_ptr() : nullptr, buffer.data_ptr(),
                                  bytesOf(buffer), root);
                   writeBack(output, buffer);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                 std::vector<std::vector<at::Tensor>>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) {
  checkSingle(outputs.size(), "reduce_scatter output");
  checkSingle(inputs.size(), "reduce_scatter input list");
  checkTimeout(opts.timeout, "reduce_scatter");
  at::Tensor output = outputs[0];
  checkOutput(output, "reduce_scatter output");
  std::vector<at::Tensor> inputList = inputs[0];
  checkListLength(inputList.size(), size_, "reduce_scatter input_list");
  for (size_t i = 0; i < inputList.size(); ++i) {
    checkTensor(inputList[i], indexed("reduce_scatter input_list", i));
    TORCH_CHECK_VALUE(inputList[i].scalar_type() == output.scalar_type(), "torus: reduce_scatter input_list[", i,
                      "] has dtype ", inputList[i].scalar_type(), " but output has ", output.scalar_type());
  }
  TORCH_CHECK_VALUE(inputList[rank_].numel() == output.numel(), "torus: reduce_scatter input_list[", rank_, "] has ",
                    inputList[rank_].numel(), " elements but output (this rank's share) has ", output.numel());
  auto reduction = reductionFor(opts.reduceOp, output.scalar_type(), "reduce_scatter");
  const size_t inputBytes = totalBytesOf(inputList);
  const Algorithm algorithm = algorithmFor("reduce_scatter", inputBytes);
  return enqueue(c10d::OpType::REDUCE_SCATTER, titleOf("torus:reduce_scatter", algorithm), {output}, inputList,
                 opts.timeout,
                 callOf(c10d::OpType::REDUCE_SCATTER, output.scalar_type(), inputBytes, opts.reduceOp.op_, -1, algorithm),
                 [this, output, inputList, reduction, algorithm](Comm& comm) mutable {
                   std::vector<at::Tensor> flat;
                   std::vector<size_t> counts;
                   for (const auto& t : inputList) {
                     flat.push_back(t.reshape({-1}));
                     counts.push_back(static_cast<size_t>(t.numel()));
                   }
                   at::Tensor buffer = at::cat(flat);
                   applyPreScale(reduction, buffer);
                   Blocks blocks = blocksOfCounts(counts);
                   runReduceScatter(algorithm, comm, buffer.data_ptr(), blocks, reduction.reducer);
                   at::Tensor mine = buffer.narrow(0, static_cast<int64_t>(blocks.offsets[rank_]),
                                                   static_cast<int64_t>(blocks.counts[rank_]));
                   applyAverage(reduction, mine);
                   output.copy_(mine.view(output.sizes()));
                 });
}

namespace {

void checkReduceScatterTensor(const at::Tensor& output, const at::Tensor& input, int size, const std::string& what) {
  checkTensor(input, what + " input");
  checkOutput(output, what + " output");
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(), "torus: ", what, " output has dtype ",
                    output.scalar_type(), " but input has ", input.scalar_type());
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size, "torus: ", what, " input has ", input.numel(),
                    " elements; it needs world size (", size, ") x output's elements (", output.numel(), ")");
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                       const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(!inputs.empty() && outputs.size() == inputs.size(), "torus: reduce_scatter_tensor has ",
                    outputs.size(), " outputs and ", inputs.size(), " inputs; it needs as many of each, at least one");
  checkTimeout(opts.timeout, "reduce_scatter_tensor");
  std::vector<Reduction> reductions;
  std::vector<Algorithm> algorithms;
  for (size_t j = 0; j < inputs.size(); ++j) {
    checkReduceScatterTensor(outputs[j], inputs[j], size_,
                             inputs.size() == 1 ? "reduce_scatter_tensor" : "reduce_scatter_tensor " + std::to_string(j));
    reductions.push_back(reductionFor(opts.reduceOp, inputs[j].scalar_type(), "reduce_scatter_tensor"));
    algorithms.push_back(algorithmFor("reduce_scatter", bytesOf(inputs[j])));
  }
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, titleOf("torus:reduce_scatter_tensor", algorithms[0]), outputs,
                 inputs, opts.timeout,
                 callOf(c10d::OpType::_REDUCE_SCATTER_BASE, inputs[0].scalar_type(), totalBytesOf(inputs),
                        opts.reduceOp.op_, -1, algorithms[0]),
                 [this, outputs, inputs, reductions, algorithms](Comm& comm) mutable {
                   for (size_t j = 0; j < inputs.size(); ++j) {
                     at::Tensor buffer = inputs[j].reshape({-1}).clone(at::MemoryFormat::Contiguous);
                     applyPreScale(reductions[j], buffer);
                     const auto count = static_cast<size_t>(outputs[j].numel());
                     runReduceScatter(algorithms[j], comm, buffer.data_ptr(),
                                      blocksOfCounts(std::vector<size_t>(static_cast<size_t>(size_), count)),
                                      reductions[j].reducer);
                     at::Tensor mine = buffer.narrow(0, static_cast<int64_t>(count) * rank_, static_cast<int64_t>(count));
                     applyAverage(reductions[j], mine);
                     outputs[j].copy_(mine.view(outputs[j].sizes()));
                   }
                 });
}

namespace {

// Byte offsets and lengths of dim-0 splits of `tensor`; even splits when `splits` is empty.
void splitBytes(const at::Tensor& tensor, const std::vector<int64_t>& splits, int size, const char* what,
                std::vector<size_t>& offsets, std::vector<size_t>& lengths) {
  const int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
  const size_t rowBytes = rows == 0 ? 0 : bytesOf(tensor) / static_cast<size_t>(rows);
  std::vector<int64_t> rowsPerRank;
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, "torus: all_to_all_single ", what, " has ", rows,
                      " rows (size of dim 0), which the world size (", size, ") does not divide; pass ", what,
                      "_split_sizes");
    rowsPerRank.assign(static_cast<size_t>(size), rows / size);
  } else {
    TORCH_CHECK_VALUE(splits.size() == static_cast<size_t>(size), "torus: all_to_all_single ", what,
                      "_split_sizes has ", splits.size(), " entries but the group has ", size, " ranks");
    int64_t total = 0;
    for (size_t i = 0; i < splits.size(); ++i) {
      TORCH_CHECK_VALUE(splits[i] >= 0 && splits[i] <= rows, "torus: all_to_all_single ", what, "_split_sizes[", i,
                        "] is ", splits[i], "; split sizes must be between 0 and the ", what, "'s rows (", rows, ")");
      total += splits[i];
    }
    TORCH_CHECK_VALUE(total == rows, "torus: all_to_all_single ", what, "_split_sizes sum to ", total, " but ", what,
                      " has ", rows, " rows (size of dim 0)");
    rowsPerRank = splits;
  }
  size_t offset = 0;
  for (int64_t r : rowsPerRank) {
    offsets.push_back(offset);
    lengths.push_back(static_cast<size_t>(r) * rowBytes);
    offset += static_cast<size_t>(r) * rowBytes;
  }
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                std::vector<int64_t>& outputSplits,
                                                                std::vector<int64_t>& inputSplits,
                                                                const c10d::AllToAllOptions& opts) {
  checkTimeout(opts.timeout, "all_to_all_single");
  checkTensor(input, "all_to_all_single input");
  checkOutput(output, "all_to_all_single output");
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(), "torus: all_to_all_single output has dtype ",
                    output.scalar_type(), " but input has ", input.scalar_type());
  std::vector<size_t> sendOffsets, sendBytes, recvOffsets, recvBytes;
  splitBytes(input, inputSplits, size_, "input", sendOffsets, sendBytes);
  splitBytes(output, outputSplits, size_, "output", recvOffsets, recvBytes);
  TORCH_CHECK_VALUE(sendBytes[rank_] == recvBytes[rank_], "torus: all_to_all_single keeps ", sendBytes[rank_],
                    " bytes of its own input (input_split_sizes[", rank_, "]) but expects ", recvBytes[rank_],
                    " in its output (output_split_sizes[", rank_, "])");
  // Totals may differ by rank (split sizes); each message's size is checked on arrival.
  return enqueue(c10d::OpType::ALLTOALL_BASE, "torus:all_to_all_single", {output}, {input}, opts.timeout,
                 callOf(c10d::OpType::ALLTOALL_BASE, input.scalar_type(), 0), [output, input, sendOffsets, sendBytes, recvOffsets, recvBytes](Comm& comm) mutable {
                   at::Tensor in = contiguousBuffer(input);
                   at::Tensor out = contiguousBuffer(output);
                   if (in.numel() > 0 && in.data_ptr() == out.data_ptr()) {
                     in = in.clone();
                   }
                   alltoallv_pairwise(comm, in.data_ptr(), sendOffsets, sendBytes, out.data_ptr(), recvOffsets,
                                      recvBytes);
                   writeBack(output, out);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::alltoall(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllToAllOptions& opts) {
  checkTimeout(opts.timeout, "all_to_all");
  checkListLength(inputs.size(), size_, "all_to_all input_tensor_list");
  checkListLength(outputs.size(), size_, "all_to_all output_tensor_list");
  std::vector<size_t> sendOffsets, sendBytes, recvOffsets, recvBytes;
  size_t sendTotal = 0, recvTotal = 0;
  for (int i = 0; i < size_; ++i) {
    checkTensor(inputs[i], indexed("all_to_all input_tensor_list", i));
    checkOutput(outputs[i], indexed("all_to_all output_tensor_list", i));
    TORCH_CHECK_VALUE(outputs[i].scalar_type() == inputs[0].scalar_type() &&
                          inputs[i].scalar_type() == inputs[0].scalar_type(),
                      "torus: all_to_all tensors must share one dtype; input_tensor_list[0] has ",
                      inputs[0].scalar_type(), ", input_tensor_list[", i, "] has ", inputs[i].scalar_type(),
                      ", output_tensor_list[", i, "] has ", outputs[i].scalar_type());
    sendOffsets.push_back(sendTotal);
    sendBytes.push_back(bytesOf(inputs[i]));
    sendTotal += bytesOf(inputs[i]);
    recvOffsets.push_back(recvTotal);
    recvBytes.push_back(bytesOf(outputs[i]));
    recvTotal += bytesOf(outputs[i]);
  }
  TORCH_CHECK_VALUE(sendBytes[rank_] == recvBytes[rank_], "torus: all_to_all input_tensor_list[", rank_, "] has ",
                    sendBytes[rank_], " bytes but output_tensor_list[", rank_, "] has ", recvBytes[rank_],
                    " (this rank's own block is copied, so they must match)");
  return enqueue(c10d::OpType::ALLTOALL, "torus:all_to_all", outputs, inputs, opts.timeout,
                 callOf(c10d::OpType::ALLTOALL, inputs[0].scalar_type(), 0), [outputs, inputs, sendOffsets, sendBytes, recvOffsets, recvBytes, recvTotal](Comm& comm) mutable {
                   at::Tensor packed = packBytes(inputs);
                   at::Tensor received = at::empty({static_cast<int64_t>(recvTotal)}, at::kByte);
                   alltoallv_pairwise(comm, packed.data_ptr(), sendOffsets, sendBytes, received.data_ptr(), recvOffsets,
                                      recvBytes);
                   for (size_t i = 0; i < outputs.size(); ++i) {
                     unpackBytes(outputs[i], received.narrow(0, static_cast<int64_t>(recvOffsets[i]),
                                                             static_cast<int64_t>(recvBytes[i])));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::barrier(const c10d::BarrierOptions& opts) {
  checkTimeout(opts.timeout, "barrier");
  return enqueue(c10d::OpType::BARRIER, "torus:barrier", {}, {}, opts.timeout,
                 callOf(c10d::OpType::BARRIER, at::kByte, 0), [](Comm& comm) { barrier_dissemination(comm); });
}

namespace {

// `what` is e.g. "send dst".
void checkPeer(int peer, int rank, int size, const char* what) {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size, "torus: ", what, "=", peer, " is out of range: the group has ", size,
                    " ranks, 0 to ", size - 1);
  TORCH_CHECK_VALUE(peer != rank, "torus: ", what, "=", peer, " is this rank itself");
}

uint64_t p2pTag(int tag) {
  TORCH_CHECK_VALUE(tag >= 0, "torus: point-to-point tags must not be negative, got ", tag);
  return kP2PTagBase + static_cast<uint64_t>(tag);
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  checkSingle(tensors.size(), "send");
  checkPeer(dstRank, rank_, size_, "send dst");
  at::Tensor tensor = tensors[0];
  checkTensor(tensor, "send tensor");
  const std::string context = p2pContext("send to rank " + std::to_string(dstRank) + " tag " + std::to_string(tag));
  checkUsable(context);
  at::Tensor buffer = contiguousBuffer(tensor);
  traffic_->count(dstRank, bytesOf(buffer));
  auto request = transport_->isend(dstRank, p2pTag(tag), CallSignature{}, buffer.data_ptr(), bytesOf(buffer));
  return c10::make_intrusive<TorusP2PWork>(rank_, c10d::OpType::SEND, "torus:send", transport_, request, tensor, buffer,
                                           timeout_, context, failure_);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  checkSingle(tensors.size(), "recv");
  checkPeer(srcRank, rank_, size_, "recv src");
  at::Tensor tensor = tensors[0];
  checkOutput(tensor, "recv tensor");
  const std::string context =
      p2pContext("recv from rank " + std::to_string(srcRank) + " tag " + std::to_string(tag));
  checkUsable(context);
  at::Tensor buffer = tensor.is_contiguous() ? tensor : at::empty_like(tensor, at::MemoryFormat::Contiguous);
  auto request = transport_->irecv(srcRank, p2pTag(tag), CallSignature{}, buffer.data_ptr(), bytesOf(buffer));
  return c10::make_intrusive<TorusP2PWork>(rank_, c10d::OpType::RECV, "torus:recv", transport_, request, tensor, buffer,
                                           timeout_, context, failure_);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkSingle(tensors.size(), "recv");
  at::Tensor tensor = tensors[0];
  checkOutput(tensor, "recv tensor");
  const std::string context = p2pContext("recv from any rank, tag " + std::to_string(tag));
  checkUsable(context);
  at::Tensor buffer = tensor.is_contiguous() ? tensor : at::empty_like(tensor, at::MemoryFormat::Contiguous);
  auto request = transport_->irecv(kAnyPeer, p2pTag(tag), CallSignature{}, buffer.data_ptr(), bytesOf(buffer));
  return c10::make_intrusive<TorusP2PWork>(rank_, c10d::OpType::RECVANYSOURCE, "torus:recv_anysource", transport_,
                                           request, tensor, buffer, timeout_, context, failure_);
}

} // namespace torus
