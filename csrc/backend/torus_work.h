// The Work objects ProcessGroupTorus returns: TorusWork for collectives run on the group's
// worker thread, TorusP2PWork for sends and receives posted straight to the transport,
// TorusBatchWork for a batch of them (batch_isend_irecv), TorusBatchedOpWork for one op of it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backend/arrival_board.h"
#include "backend/device_support.h"
#include "backend/dump_signal.h"
#include "backend/flight_recorder.h"
#include "backend/wait_watch.h"
#include "transport/transport.h"

namespace torus {

// Turns a failure of ours into the exception torch.distributed users catch:
// CommError (peer death, timeout, mismatch, abort) becomes DistBackendError, prefixed with
// `context` (the collective, its sequence number and this rank); others keep their type. A
// peer's failure also says "connection closed by peer", as gloo's does.
std::exception_ptr asTorchError(std::exception_ptr error, const std::string& context);

// The message of an exception (without c10's backtrace).
std::string describeException(std::exception_ptr error);

// " (the timeout of 2000 ms expired)": what every timeout's text says after our own, so that it
// carries the words torch's tests and tools match (" (Timed out|closed|timeout) ").
std::string timeoutExpired(std::chrono::milliseconds timeout);

// The first failure of a group, shared by its worker thread and its point-to-point works: once
// one is recorded, every later call on the group fails at once, naming it.
class GroupFailure {
 public:
  // Records `what` unless a failure is recorded already.
  void record(const std::string& what);
  // The recorded failure; empty while there is none.
  std::string get() const;
  // Whether one is recorded: a check without a lock, for every call's fast path.
  bool failed() const {
    return failed_.load(std::memory_order_acquire);
  }
  // Raises DistBackendError naming `context` and the recorded failure, if there is one.
  void throwIfFailed(const std::string& context) const;

 private:
  mutable std::mutex mutex_;
  std::string what_;
  std::atomic<bool> failed_{false};
};

// Whose a collective is, for the texts of its errors and logs: built once per group, so that a
// call formats nothing unless it fails or logs.
struct GroupLabel {
  int rank;
  int size;
  std::string name;

  // "torus:all_reduce:ring #7 (rank 0 of 4, group '0')"; "(queued)" for seq 0, not started.
  std::string context(const char* title, uint64_t seq) const;
};

// Collectives' works. torch calls synchronize() with the Work's lock held (from Work::wait) and
// takes it in exception(), finish() and the base isCompleted(): so none of the overrides here
// calls anything that takes that lock; they read done_ and failed_, flags of their own. done_ is
// set by the future's first callback, before the user's: wait() and is_completed() do not wait
// for callbacks (which may wait for later collectives themselves), and once they say done the
// future's value or error is there.
class TorusWork : public c10d::Work {
 public:
  // `device`: the call's device side, or null for CPU tensors; with one, the future is aware of
  // its devices and wait() orders the caller's current stream after the job. `watch`: the
  // debug mode's report of waits that do not return (null: off).
  TorusWork(int rank, c10d::OpType opType, const char* profilingTitle, std::vector<at::Tensor> outputs,
            const std::optional<std::vector<at::Tensor>>& inputs,
            std::shared_ptr<const GroupLabel> label, std::shared_ptr<const ArrivalBoard> arrivals,
            std::shared_ptr<DeviceCall> device, std::shared_ptr<WaitWatch> watch);

  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }
  // 0 while the collective is queued.
  uint64_t getSequencenumber() const override {
    return seq_.load(std::memory_order_acquire);
  }
  // Spins briefly (yielding) before sleeping: small collectives finish within microseconds, and
  // a sleep on the condition variable would cost a wake-up, many more on an oversubscribed host.
  // A `timeout` that passes raises DistBackendError naming the collective and the ranks that had
  // not reached it; the collective itself goes on, bounded by its own timeout.
  bool wait(std::chrono::milliseconds timeout) override;
  // Device calls: done on the host and on the device.
  bool isCompleted() override;
  // The job's error once it failed; no error while it runs (torch's own read these under the
  // Work's lock).
  std::exception_ptr exception() const override;
  bool isSuccess() const override;
  // Device calls that succeeded: the current stream waits for the job (Work.synchronize(), and
  // Work::wait with the Work's lock held). A host wait that passes the stall bound raises
  // DistBackendError naming the collective.
  void synchronize() override;

  // Called once by the job's runner: when it starts, with its place in the run order; then one of
  // complete() and fail().
  void start(uint64_t seq) {
    seq_.store(seq, std::memory_order_release);
  }
  void complete();
  void fail(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<uint64_t> seq_{0};
  const char* const title_;
  const std::shared_ptr<const GroupLabel> label_;
  const std::shared_ptr<const ArrivalBoard> arrivals_;
  const std::shared_ptr<DeviceCall> device_;
  const std::shared_ptr<WaitWatch> watch_;
  // Sets done_ and wakes wait(): the future's first callback.
  void settled();

  std::mutex doneMutex_;
  std::condition_variable doneChanged_;
  std::atomic<bool> done_{false};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_; // written once, before failed_
  // When the job completed or failed (steady clock, ns), for the debug mode's report.
  std::atomic<int64_t> finishedAt_{0};
};

class TorusP2PWork : public c10d::Work {
 public:
  // `buffer` is what the transport reads or writes; for a receive into a non-contiguous tensor
  // it is a contiguous stand-in copied into `tensor` on completion.
  // A send or receive that fails (its timeout, or Work.wait's, passes; the peer dies) fails the
  // group: its buffer would otherwise stay promised to the transport, which could write into it
  // after the caller has moved on.
  TorusP2PWork(int rank, c10d::OpType opType, const char* profilingTitle, std::shared_ptr<Transport> transport,
               RequestPtr request, at::Tensor tensor, at::Tensor buffer, std::chrono::milliseconds timeout,
               std::string context, std::shared_ptr<GroupFailure> groupFailure,
               std::shared_ptr<FlightRecorder> recorder, std::shared_ptr<DumpSignal> dumps, uint64_t recordId);

  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout) override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override {
    return {tensor_};
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  void settle(std::exception_ptr error);
  // Settles with `error`; a transport's error fails the group: aborts the transport, asks the
  // peers to dump and dumps here, as a collective's failure does.
  void fail(std::exception_ptr error);

  std::shared_ptr<Transport> transport_;
  RequestPtr request_;
  at::Tensor tensor_;
  at::Tensor buffer_;
  std::chrono::milliseconds timeout_;
  std::string context_;
  std::shared_ptr<GroupFailure> groupFailure_;
  std::shared_ptr<FlightRecorder> recorder_;
  std::shared_ptr<DumpSignal> dumps_;
  const uint64_t recordId_;
  std::atomic<bool> settled_{false};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// What a send or receive issued inside a batch (between startCoalescing and endCoalescing)
// returns: the batch posts it, and endCoalescing's work is the one to wait for.
class TorusBatchedOpWork : public c10d::Work {
 public:
  TorusBatchedOpWork(int rank, c10d::OpType opType) : c10d::Work(rank, opType) {}
  bool wait(std::chrono::milliseconds timeout) override;
};

// The work of the calls issued between startCoalescing and endCoalescing: done when each is;
// wait() waits for each in turn and raises the first failure.
class TorusBatchWork : public c10d::Work {
 public:
  TorusBatchWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works);

  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout) override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace torus
