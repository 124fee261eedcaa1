#include "backend/collective_executor.h"

#include <algorithm>

#include "backend/callback_scope.h"
#include "backend/log.h"
#include "backend/process_ending.h"
#include "backend/store_within.h"
#include "backend/tensor_checks.h"
#include "transport/spin_wait.h"

namespace torus {

CollectiveExecutor::CollectiveExecutor(int rank, int size, std::string groupName, int logLevel,
                                       std::chrono::milliseconds stallBound, std::shared_ptr<Transport> transport,
                                       Comm& comm, std::shared_ptr<ArrivalBoard> arrivals,
                                       std::shared_ptr<DumpSignal> dumps, std::shared_ptr<GroupFailure> failure,
                                       std::shared_ptr<FlightRecorder> recorder)
    : rank_(rank),
      label_(std::make_shared<const GroupLabel>(GroupLabel{rank, size, std::move(groupName)})),
      logLevel_(logLevel),
      transport_(std::move(transport)),
      comm_(comm),
      arrivals_(std::move(arrivals)),
      dumps_(std::move(dumps)),
      failure_(std::move(failure)),
      recorder_(std::move(recorder)),
      watch_(logLevel >= 2 ? std::make_shared<WaitWatch>(rank, stallBound / 2) : nullptr),
      worker_(&CollectiveExecutor::runWorker, this) {
  comm_.setFailureHandler([this](std::exception_ptr raised) { failRunning(raised); });
}

CollectiveExecutor::~CollectiveExecutor() {
  stop(false);
}

uint64_t CollectiveExecutor::issued() {
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_;
}

bool CollectiveExecutor::idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !busy_ && queue_.empty();
}

c10::intrusive_ptr<c10d::Work> CollectiveExecutor::enqueue(const CallDescription& call,
                                                           std::vector<at::Tensor> outputs,
                                                           std::vector<at::Tensor> inputs,
                                                           std::chrono::milliseconds timeout, Body body,
                                                           std::shared_ptr<DeviceCall> device, bool mayRunHere) {
  PythonCallScope pythonCall;
  const char* title = call.title();
  const auto makeWork = [&] {
    return c10::make_intrusive<TorusWork>(rank_, call.type, title, std::move(outputs), std::move(inputs), label_,
                                          arrivals_, device, watch_);
  };
  std::unique_lock<std::mutex> lock(mutex_);
  TORUS_CHECK(!stopping_, title, " called on a process group that has been shut down or aborted");
  ++issued_;
  const bool nested = CallbackScope::inCallbacksOf(this);
  const CallPlace place = CallbackScope::placeNewCall();
  // A call that runs here at once is recorded as started; one that waits, as queued.
  if (mayRunHere && !device && !nested && claimIfIdle()) {
    const uint64_t seq = nextSeqOfClaimer();
    lock.unlock();
    c10::intrusive_ptr<TorusWork> work;
    uint64_t recordId = 0;
    try {
      recordId = record(call, title, inputs, outputs, seq);
      work = makeWork();
    } catch (...) {
      releaseCallingThread();
      throw;
    }
    Job job{work, 0, place, title, timeout, signatureOf(call), std::move(body), nullptr, nullptr, recordId, true};
    {
      SpinWait::CallerWaits callerWaits;
      execute(job);
    }
    releaseCallingThread();
    return work;
  }
  const uint64_t recordId = record(call, title, inputs, outputs, 0);
  auto work = makeWork();
  Job job{work, 0, place, title, timeout, signatureOf(call), std::move(body), std::move(device), nullptr, recordId};
  if (nested) {
    // Issued by a callback this worker runs: what comes before it runs first, here, then it, as
    // the callback may wait for it.
    insert(std::move(job));
    lock.unlock();
    drainThrough(place, work.get());
    return work;
  }
  insert(std::move(job));
  if (!completing_.empty()) {
    noteStall();
  }
  lock.unlock();
  queueChanged_.notify_one();
  return work;
}

bool CollectiveExecutor::runHereIfIdle(const CallDescription& call, std::chrono::milliseconds timeout, Body& body) {
  PythonCallScope pythonCall;
  const char* title = call.title();
  std::unique_lock<std::mutex> lock(mutex_);
  TORUS_CHECK(!stopping_, title, " called on a process group that has been shut down or aborted");
  const bool nested = CallbackScope::inCallbacksOf(this);
  if (!nested && !claimIfIdle()) {
    return false;
  }
  ++issued_;
  const CallPlace place = CallbackScope::placeNewCall();
  // Nested, the queued calls before it run first: its number is not known yet.
  Job job{nullptr, 0, place, title, timeout, signatureOf(call), std::move(body), nullptr, nullptr,
          record(call, title, {}, {}, nested ? 0 : nextSeqOfClaimer()), !nested};
  lock.unlock();
  if (nested) {
    drainThrough(place, nullptr);
  }
  std::exception_ptr error;
  {
    // Nested, it runs inside callbacks, on the worker, whose waits yield.
    SpinWait::CallerWaits callerWaits(!nested);
    error = attempt(job);
  }
  recorder_->finished(job.recordId, error ? describeException(error) : std::string());
  if (nested) {
    ranInCallbacks();
  } else {
    releaseCallingThread();
  }
  if (error) {
    std::rethrow_exception(error);
  }
  return true;
}

uint64_t CollectiveExecutor::record(const CallDescription& call, const char* title,
                                    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                                    uint64_t startedAs) {
  return recorder_->record(
      FlightRecorder::Call{title, false, call.dtype, call.root,
                           CallbackScope::currentOrigin() != CallSignature::kOriginCaller,
                           call.op ? reduceOpName(*call.op) : nullptr, call.nbytes},
      inputs, outputs, startedAs);
}

uint64_t CollectiveExecutor::nextSeqOfClaimer() const {
  // Only the thread that holds the executor (busy_) starts jobs, so the next is its.
  return started_ + 1;
}

void CollectiveExecutor::insert(Job job) {
  // The queue is in order of place; a callback's call goes before calls issued after its
  // callback was attached.
  const auto at = std::upper_bound(queue_.begin(), queue_.end(), job.place,
                                   [](const CallPlace& place, const Job& queued) { return place < queued.place; });
  queue_.insert(at, std::move(job));
}

CallSignature CollectiveExecutor::signatureOf(const CallDescription& call) {
  CallSignature signature = call.signature();
  signature.origin = CallbackScope::currentOrigin();
  return signature;
}

void CollectiveExecutor::drainThrough(const CallPlace& place, const TorusWork* target) {
  for (;;) {
    Job job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Started means run: a nested drain runs what it starts before it returns. Without it in
      // the queue, the stall watch or an abort failed it.
      if ((target != nullptr && target->getSequencenumber() != 0) || queue_.empty() ||
          place < queue_.front().place) {
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    executeWithCallbacks(job);
    ranInCallbacks();
  }
}

bool CollectiveExecutor::claimIfIdle() {
  if (busy_ || !queue_.empty()) {
    return false;
  }
  busy_ = true;
  return true;
}

void CollectiveExecutor::releaseCallingThread() {
  std::unique_lock<std::mutex> lock(mutex_);
  busy_ = false;
  // Calls queued meanwhile by other threads wait for the worker.
  const bool queued = !queue_.empty();
  lock.unlock();
  if (queued) {
    queueChanged_.notify_one();
  }
}

void CollectiveExecutor::runWorker() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      const auto ready = [&] { return !queue_.empty() && !busy_; };
      // Spin briefly before sleeping: a caller issuing collectives back to back hands over the
      // next one within microseconds, and a condition-variable sleep would cost a wake-up.
      const auto spinUntil = Clock::now() + kSpinBeforeSleep;
      while (!stopping_ && !ready() && Clock::now() < spinUntil) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
      }
      queueChanged_.wait(lock, [&] { return ready() || (stopping_ && queue_.empty()); });
      if (queue_.empty()) {
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    executeWithCallbacks(job);
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
  }
}

void CollectiveExecutor::execute(Job& job) {
  finish(job, attempt(job));
}

void CollectiveExecutor::finish(Job& job, std::exception_ptr error) {
  recorder_->finished(job.recordId, error ? describeException(error) : std::string());
  if (error) {
    job.work->fail(error);
  } else {
    job.work->complete();
  }
  // A device call's stream stays current until the work is completed, so that its CUDA-aware
  // future records its events there.
  job.deviceScope.reset();
}

void CollectiveExecutor::executeWithCallbacks(Job& job) {
  std::exception_ptr error = attempt(job);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    completing_.emplace_back(job.seq, job.title);
    if (completing_.size() == 1) {
      completingSince_ = Clock::now();
    }
    if (!queue_.empty()) {
      noteStall();
    }
  }
  {
    CallbackScope callbacks(this, CallPlace{});
    finish(job, error);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  completing_.pop_back();
  if (completing_.empty()) {
    stalledSince_.reset();
  }
}

void CollectiveExecutor::ranInCallbacks() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stalledSince_) {
    stalledSince_ = Clock::now();
  }
}

void CollectiveExecutor::noteStall() {
  if (stalledSince_) {
    return;
  }
  stalledSince_ = Clock::now();
  if (!stallWatch_.joinable()) {
    stallWatch_ = std::thread(&CollectiveExecutor::watchStalls, this);
  }
  stallChanged_.notify_all();
}

void CollectiveExecutor::watchStalls() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    if (!stalledSince_ || queue_.empty()) {
      stallChanged_.wait(lock);
      continue;
    }
    const auto until = *stalledSince_ + queue_.front().timeout;
    if (Clock::now() < until) {
      stallChanged_.wait_until(lock, until);
    } else {
      failStalled(lock);
    }
  }
}

void CollectiveExecutor::failStalled(std::unique_lock<std::mutex>& lock) {
  std::deque<Job> stalled;
  stalled.swap(queue_);
  stalledSince_.reset();
  const auto& [seq, title] = completing_.front();
  const auto inCallbacks = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - completingSince_);
  std::string why =
      "did not start: queued behind " + label_->context(title, seq) + ", whose future's callbacks have not returned in " +
      std::to_string(inCallbacks.count()) +
      " ms (collectives run in order, a callback's at the place of its then(): does a callback wait for a "
      "collective issued after its then()?)" +
      timeoutExpired(stalled.front().timeout);
  const std::string first = contextOf(stalled.front());
  lock.unlock();
  transport_->abort(first + ": " + why);
  dumps_->raise(first + ": " + why);
  why += FlightRecorder::errorNote(recorder_->dump("the queue stalled behind callbacks", ""));
  failure_->record(first + ": " + why);
  failQueued(stalled, CommError(CommError::Kind::kTimeout, why));
  lock.lock();
}

void CollectiveExecutor::failQueued(std::deque<Job>& jobs, const CommError& error) {
  for (Job& job : jobs) {
    recorder_->finished(job.recordId, error.what());
    job.work->fail(asTorchError(std::make_exception_ptr(error), contextOf(job)));
  }
}

std::exception_ptr CollectiveExecutor::attempt(Job& job) {
  job.seq = ++started_;
  if (job.work) {
    job.work->start(job.seq);
  }
  if (!job.recordedStarted) {
    recorder_->started(job.recordId, job.seq);
  }
  try {
    if (failure_->failed()) {
      failure_->throwIfFailed(contextOf(job));
    }
    return run(job);
  } catch (...) {
    return asTorchError(std::current_exception(), contextOf(job));
  }
}

std::string CollectiveExecutor::contextOf(const Job& job) const {
  return label_->context(job.title, job.seq);
}

std::exception_ptr CollectiveExecutor::run(Job& job) {
  const uint64_t seq = job.seq;
  running_ = &job;
  runningFailure_.reset();
  try {
    if (logLevel_ >= 2) {
      logLine(rank_, contextOf(job));
    }
    comm_.setTag(seq);
    comm_.setCall(job.call);
    comm_.setDeadline(Clock::now() + job.timeout);
    recentCalls_[seq % recentCalls_.size()] = {seq, job.call};
    arrivals_->entered(seq, job.timeout);
    // Inside the job's failure handling: a rank that cannot enter fails the group, as any failure
    // of a job does, rather than leave its peers waiting for its messages.
    if (job.device) {
      job.deviceScope = job.device->enter();
    }
    job.body(comm_, job.device.get());
    if (auto stray = transport_->strayMessage(seq)) {
      const auto& [callSeq, call] = recentCalls_[stray->tag % recentCalls_.size()];
      throw CommError(CommError::Kind::kMismatch, "stray message",
                      CallMismatch{stray->peer, stray->tag, callSeq == stray->tag ? call : CallSignature{},
                                   stray->call});
    }
    if (job.device) {
      job.device->recordDone();
    }
  } catch (...) {
    failRunning(withReadyEvent(job, std::current_exception()));
  }
  arrivals_->left();
  running_ = nullptr;
  return runningFailure_ ? runningFailure_->error : nullptr;
}

std::exception_ptr CollectiveExecutor::withReadyEvent(const Job& job, std::exception_ptr raised) {
  if (!job.device) {
    return raised;
  }
  try {
    std::rethrow_exception(raised);
  } catch (const CommError& e) {
    if (e.kind() == CommError::Kind::kTimeout && !job.device->readyReached()) {
      return std::make_exception_ptr(
          CommError(e.kind(), std::string(e.what()) + "; the caller's stream had not reached the collective's ready "
                                                      "event: work queued on it before the collective had not finished"));
    }
  } catch (...) {
  }
  return raised;
}

void CollectiveExecutor::failRunning(std::exception_ptr raised) {
  if (running_ == nullptr || runningFailure_) {
    return;
  }
  // Abort first: the failed collective's other sends and receives still point into its buffers
  // and the scratch, and the peers wait; end them all and tell the peers (and ask them to dump)
  // before anything here waits on the store, which may be frozen with the rank that hung.
  const std::string told = failureOf(raised, "", "").text;
  transport_->abort(told);
  const std::optional<CommError> error = transportFailure(raised);
  if (!error || error->kind() != CommError::Kind::kAborted) {
    dumps_->raise(told);
  }
  // Then diagnose: who never came, from one batched store read under its own deadline. A peer that
  // gave up told only what it knew before its own read, so a rank that has waited here a while
  // reads too (describeMissing asks the store only after this rank published its arrival).
  const bool diagnose = !aborting_.load() && error && (ownTimeout(*error) || error->kind() == CommError::Kind::kPeer);
  const std::string missing = diagnose ? arrivals_->describeMissing(running_->seq) : std::string();
  recorder_->finished(running_->recordId, failureOf(raised, missing, "").text);
  const std::string path = recorder_->dump("collective failed", missing);
  runningFailure_ = failureOf(raised, missing, FlightRecorder::errorNote(path));
  failure_->record(runningFailure_->text);
}

std::optional<CommError> CollectiveExecutor::transportFailure(std::exception_ptr raised) {
  try {
    std::rethrow_exception(raised);
  } catch (const CommError& e) {
    if (!e.mismatch()) {
      return e;
    }
  } catch (...) {
  }
  return std::nullopt;
}

bool CollectiveExecutor::ownTimeout(const CommError& error) {
  // A device phase's stall says its own bound; other timeouts are the collective's.
  return error.kind() == CommError::Kind::kTimeout && std::string(error.what()).rfind(kStalledIn, 0) != 0;
}

CollectiveExecutor::JobFailure CollectiveExecutor::failureOf(std::exception_ptr raised, const std::string& missing,
                                                             const std::string& note) const {
  const std::string context = contextOf(*running_);
  try {
    std::rethrow_exception(raised);
  } catch (const CommError& e) {
    const std::string what = explain(e, running_->timeout, missing) + note;
    return {asTorchError(std::make_exception_ptr(CommError(e.kind(), what)), context), context + ": " + what};
  } catch (...) {
    // Not the transport's failure (an allocation, a torch op, a bad grid), but the collective's
    // sends and receives may still be posted into its buffers, and the ranks are out of step:
    // the group fails as for a transport failure, naming the cause.
    std::exception_ptr error = asTorchError(raised, context);
    return {error, context + ": " + describeException(error)};
  }
}

std::string CollectiveExecutor::explain(const CommError& error, std::chrono::milliseconds timeout,
                                        const std::string& missing) const {
  if (error.mismatch()) {
    const CallMismatch& mismatch = *error.mismatch();
    std::string what = "ranks called different collectives";
    if (mismatch.tag != running_->seq) {
      what += " at #" + std::to_string(mismatch.tag);
    }
    return what + ": rank " + std::to_string(rank_) + " called " +
           (mismatch.mine.kind != 0 ? describeCall(mismatch.mine) : std::string("another collective")) + ", rank " +
           std::to_string(mismatch.peer) + " called " + describeCall(mismatch.theirs);
  }
  std::string what = error.what();
  if (ownTimeout(error)) {
    what += timeoutExpired(timeout);
  }
  if (!missing.empty()) {
    what += "; " + missing;
  }
  return what;
}

void CollectiveExecutor::stop(bool abortPending) {
  std::deque<Job> abandoned;
  std::string why = "the process group was aborted";
  bool running;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    running = busy_ || !completing_.empty();
    if (abortPending) {
      abandoned.swap(queue_);
    } else if (!completing_.empty()) {
      // Queued jobs behind callbacks never run if a callback waits for one of them: they fail
      // rather than keep destroy_process_group waiting.
      abandoned.swap(queue_);
      const auto& [seq, title] = completing_.back();
      why = "the process group was destroyed before this collective started, while its worker was in the "
            "callbacks of " + label_->context(title, seq);
    }
  }
  queueChanged_.notify_all();
  stallChanged_.notify_all();
  // A planned abort with nothing queued or running (torchft's at every quorum change) leaves
  // nothing to look at; one that cuts calls short dumps them, without asking the store.
  if (abortPending && (!abandoned.empty() || running)) {
    recorder_->dump("the group was aborted", "");
  }
  failQueued(abandoned, CommError(CommError::Kind::kAborted, why));
  if (worker_.joinable()) {
    worker_.join();
  }
  if (stallWatch_.joinable()) {
    stallWatch_.join();
  }
  // An abort waits for neither thread: each ends by itself once its store call's deadline passes.
  const auto patience = abortPending ? std::chrono::milliseconds(0) : kStoreDeadline;
  arrivals_->stop(patience);
  dumps_->stop(patience);
}

std::string CollectiveExecutor::dumpTrace(const std::string& reason) {
  const uint64_t seq = arrivals_->current();
  return recorder_->dump(reason, seq == 0 ? std::string() : arrivals_->describeMissing(seq));
}

} // namespace torus
