#include "backend/torus_work.h"

#include <thread>

#include <torch/csrc/distributed/c10d/exception.h>

#include "backend/callback_scope.h"

namespace torus {

namespace {

c10::intrusive_ptr<c10::ivalue::Future> makeTensorListFuture(std::vector<c10::Device> devices = {}) {
  // One type for every future: creating it is an allocation per call.
  static const c10::TypePtr tensorList = c10::ListType::create(c10::TensorType::get());
  return c10::make_intrusive<c10::ivalue::Future>(tensorList, std::move(devices));
}

} // namespace

std::exception_ptr asTorchError(std::exception_ptr error, const std::string& context) {
  try {
    std::rethrow_exception(error);
  } catch (const CommError& e) {
    std::string what = context + ": " + e.what();
    // The transports word a peer's end their own way ("rank 2 closed its connection", "rank 2
    // (pid 7) exited", "rank 2 gave up on the group: ..."); torch's tests and tools look for
    // " closed " in it.
    if (e.kind() == CommError::Kind::kPeer && what.find(" closed ") == std::string::npos) {
      what += " (connection closed by peer)";
    }
    try {
      C10_THROW_ERROR(DistBackendError, what);
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
    return std::current_exception();
  }
}

std::string describeException(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception of unknown type";
  }
}

std::string timeoutExpired(std::chrono::milliseconds timeout) {
  return " (the timeout of " + std::to_string(timeout.count()) + " ms expired)";
}

void GroupFailure::record(const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (what_.empty()) {
    what_ = what;
    failed_.store(true, std::memory_order_release);
  }
}

std::string GroupFailure::get() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return what_;
}

std::string GroupLabel::context(const char* title, uint64_t seq) const {
  return std::string(title) + (seq == 0 ? std::string(" (queued)") : " #" + std::to_string(seq)) + " (rank " +
         std::to_string(rank) + " of " + std::to_string(size) + ", group '" + name + "')";
}

void GroupFailure::throwIfFailed(const std::string& context) const {
  const std::string earlier = get();
  if (!earlier.empty()) {
    C10_THROW_ERROR(DistBackendError, context + ": the group is unusable after an earlier failure: " + earlier);
  }
}

TorusWork::TorusWork(int rank, c10d::OpType opType, const char* profilingTitle, std::vector<at::Tensor> outputs,
                     const std::optional<std::vector<at::Tensor>>& inputs,
                     std::shared_ptr<const GroupLabel> label, std::shared_ptr<const ArrivalBoard> arrivals,
                     std::shared_ptr<DeviceCall> device, std::shared_ptr<WaitWatch> watch)
    : c10d::Work(rank, opType, profilingTitle, inputs),
      outputs_(std::move(outputs)),
      future_(device ? makeTensorListFuture(device->futureDevices()) : makeTensorListFuture()),
      title_(profilingTitle),
      label_(std::move(label)),
      arrivals_(std::move(arrivals)),
      device_(std::move(device)),
      watch_(std::move(watch)) {
  // The work outlives its future's completion: the executor holds it until then.
  future_->addCallback([this](c10::ivalue::Future&) { settled(); }, /*uses_future=*/false);
}

void TorusWork::settled() {
  {
    std::lock_guard<std::mutex> lock(doneMutex_);
    done_.store(true, std::memory_order_release);
  }
  doneChanged_.notify_all();
}

bool TorusWork::wait(std::chrono::milliseconds timeout) {
  WaitWatch::Waiting watched(watch_.get(), [this] { return label_->context(title_, getSequencenumber()); }, finishedAt_);
  const auto spinUntil = Clock::now() + kSpinBeforeSleep;
  while (!done_.load(std::memory_order_acquire) && Clock::now() < spinUntil) {
    std::this_thread::yield();
  }
  if (!done_.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> lock(doneMutex_);
    const auto done = [&] { return done_.load(std::memory_order_acquire); };
    if (timeout == kNoTimeout) {
      // Bounded by the job: its own timeout once it runs, the stall watch while it is queued.
      doneChanged_.wait(lock, done);
    } else if (!doneChanged_.wait_for(lock, timeout, done)) {
      lock.unlock();
      const uint64_t seq = getSequencenumber();
      std::string what = label_->context(title_, seq) + ": Work.wait timed out" + timeoutExpired(timeout);
      if (auto missing = arrivals_->describeMissing(seq); !missing.empty()) {
        what += "; " + missing;
      }
      C10_THROW_ERROR(DistBackendError, what + " (the collective goes on, bounded by its own timeout)");
    }
  }
  if (failed_.load(std::memory_order_acquire)) {
    std::rethrow_exception(error_);
  }
  synchronize();
  return true;
}

bool TorusWork::isCompleted() {
  if (!done_.load(std::memory_order_acquire)) {
    return false;
  }
  return !device_ || failed_.load(std::memory_order_acquire) || device_->deviceDone();
}

std::exception_ptr TorusWork::exception() const {
  return failed_.load(std::memory_order_acquire) ? error_ : nullptr;
}

bool TorusWork::isSuccess() const {
  return !failed_.load(std::memory_order_acquire);
}

void TorusWork::synchronize() {
  if (!device_ || !done_.load(std::memory_order_acquire) || failed_.load(std::memory_order_acquire)) {
    return;
  }
  try {
    device_->blockCurrentStream();
  } catch (const CommError& e) {
    C10_THROW_ERROR(DistBackendError, label_->context(title_, getSequencenumber()) + ": " + e.what());
  }
}

void TorusWork::complete() {
  finishedAt_.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void TorusWork::fail(std::exception_ptr error) {
  finishedAt_.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
  error_ = error;
  failed_.store(true, std::memory_order_release);
  future_->setError(error);
  finish(error);
}

TorusP2PWork::TorusP2PWork(int rank, c10d::OpType opType, const char* profilingTitle,
                           std::shared_ptr<Transport> transport, RequestPtr request, at::Tensor tensor,
                           at::Tensor buffer, std::chrono::milliseconds timeout, std::string context,
                           std::shared_ptr<GroupFailure> groupFailure, std::shared_ptr<FlightRecorder> recorder,
                           std::shared_ptr<DumpSignal> dumps, uint64_t recordId)
    : c10d::Work(rank, opType, profilingTitle, std::vector<at::Tensor>{tensor}),
      transport_(std::move(transport)),
      request_(std::move(request)),
      tensor_(std::move(tensor)),
      buffer_(std::move(buffer)),
      timeout_(timeout),
      context_(std::move(context)),
      groupFailure_(std::move(groupFailure)),
      recorder_(std::move(recorder)),
      dumps_(std::move(dumps)),
      recordId_(recordId),
      future_(makeTensorListFuture()) {}

void TorusP2PWork::settle(std::exception_ptr error) {
  if (settled_.exchange(true)) {
    return;
  }
  recorder_->finished(recordId_, error ? describeException(error) : std::string());
  // Callbacks attached before it settled run here, on whichever thread waited or tested.
  CallbackScope callbacks(nullptr, CallPlace{});
  if (error) {
    future_->setError(error);
    finish(error);
    return;
  }
  if (!buffer_.is_same(tensor_)) {
    tensor_.copy_(buffer_);
  }
  future_->markCompleted(c10::IValue(std::vector<at::Tensor>{tensor_}));
  finish();
}

void TorusP2PWork::fail(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const CommError& e) {
    const std::string what = context_ + ": " + e.what();
    transport_->abort(what);
    if (e.kind() != CommError::Kind::kAborted) {
      dumps_->raise(what);
    }
    recorder_->finished(recordId_, what);
    const std::string note = FlightRecorder::errorNote(recorder_->dump("a send or receive failed", ""));
    groupFailure_->record(what + note);
    settle(asTorchError(std::make_exception_ptr(CommError(e.kind(), e.what() + note)), context_));
    return;
  } catch (...) {
    // Not the transport's failure: the group stays usable.
  }
  settle(asTorchError(error, context_));
}

bool TorusP2PWork::isCompleted() {
  if (!settled_) {
    try {
      if (transport_->test(request_)) {
        settle(nullptr);
      }
    } catch (...) {
      fail(std::current_exception());
    }
  }
  return c10d::Work::isCompleted();
}

bool TorusP2PWork::wait(std::chrono::milliseconds timeout) {
  if (!settled_) {
    auto limit = timeout == ::kNoTimeout ? timeout_ : timeout;
    try {
      transport_->wait({request_}, Clock::now() + limit);
      settle(nullptr);
    } catch (const CommError& e) {
      fail(std::make_exception_ptr(
          e.kind() == CommError::Kind::kTimeout ? CommError(e.kind(), e.what() + timeoutExpired(limit)) : e));
    } catch (...) {
      fail(std::current_exception());
    }
  }
  return c10d::Work::wait(std::chrono::milliseconds(0));
}

int TorusP2PWork::sourceRank() const {
  return request_->peer();
}

bool TorusBatchedOpWork::wait(std::chrono::milliseconds) {
  TORCH_CHECK(false, "torus: this ", c10d::opTypeToString(retrieveOpType()),
              " is part of a batch (startCoalescing): wait for the work endCoalescing returned");
}

TorusBatchWork::TorusBatchWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works)
    : c10d::Work(rank, c10d::OpType::COALESCED, "torus:coalesced"), works_(std::move(works)) {
  future_ = makeTensorListFuture();
  const std::vector<at::Tensor> tensors = result();
  if (works_.empty()) {
    future_->markCompleted(c10::IValue(tensors));
  }
  // Completes with the last of them, or fails with the first failure.
  auto remaining = std::make_shared<std::atomic<size_t>>(works_.size());
  for (const auto& work : works_) {
    work->getFuture()->addCallback([future = future_, remaining, tensors](c10::ivalue::Future& done) {
      if (done.hasError()) {
        future->setErrorIfNeeded(done.exception_ptr());
      }
      if (--*remaining == 0 && !future->completed()) {
        future->markCompleted(c10::IValue(tensors));
      }
    });
  }
}

bool TorusBatchWork::isCompleted() {
  bool done = true;
  for (const auto& work : works_) {
    done = work->isCompleted() && done;
  }
  return done;
}

bool TorusBatchWork::wait(std::chrono::milliseconds timeout) {
  try {
    for (const auto& work : works_) {
      work->wait(timeout);
    }
  } catch (...) {
    finish(std::current_exception());
    throw;
  }
  finish();
  return true;
}

std::vector<at::Tensor> TorusBatchWork::result() {
  std::vector<at::Tensor> tensors;
  for (const auto& work : works_) {
    for (at::Tensor& tensor : work->result()) {
      tensors.push_back(tensor);
    }
  }
  return tensors;
}

} // namespace torus
