// CollectiveExecutor: the group's one worker thread and its failure policy. Collectives are
// queued as jobs and run in issue order, which is the same on every rank; each returns a
// TorusWork at once. A call its caller waits for at once (async_op=False) that finds the queue
// empty and the worker idle runs on the calling thread instead, and returns completed: no
// hand-off to the worker and no wake-up, the same order. A job's failure is recorded for the
// group (later calls fail fast naming it), turned into the error torch users catch
// (DistBackendError for a peer's death, a timeout, a mismatch or an abort — naming the ranks that
// never came, or both sides of a mismatch), and aborts the transport before the job's buffers are
// freed.
//
// Completing a job runs its future's callbacks (then(), DDP comm hooks such as PowerSGD) on the
// worker. A collective a callback issues takes its place at the point where the callback was
// attached (CallbackScope): after every collective issued before then(), before every one issued
// after it. That place is the same on every rank whatever the timing, whether the callback ran
// on the worker when its collective completed or at once inside then() because it had completed
// already; where the attach point is not known (a callback attached from C++), the place is where
// it is issued, as gloo's are. The callback may wait for its collective (PowerSGD does), so the
// worker, being in callbacks, runs the queue up to it at once, inside the callback: callbacks and
// collectives share the one thread, which keeps both the order and the callback that waits. A
// callback that waits for a collective placed after it would wait forever: when the worker has
// run nothing for a queued job's timeout, being in callbacks, the stall watch fails the group and
// the queued jobs, naming the job whose callbacks they waited behind. Every call's signature says
// whether a callback issued it, so ranks that still placed a callback's collective and the
// caller's at one sequence number fail with a mismatch naming both rather than mix their data.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/arrival_board.h"
#include "backend/call_description.h"
#include "backend/callback_scope.h"
#include "backend/device_support.h"
#include "backend/dump_signal.h"
#include "backend/flight_recorder.h"
#include "backend/torus_work.h"
#include "comm/comm.h"

namespace torus {

class CollectiveExecutor {
 public:
  // The job: runs on the worker with the group's Comm, and the call's device side (null for CPU
  // tensors) whose stream is current meanwhile.
  using Body = std::function<void(Comm&, DeviceCall*)>;

  // Runs jobs on `comm`, whose transport it aborts when a job fails. `stallBound`: the device
  // phases' bound (TORUS_DEVICE_STALL_TIMEOUT); at logLevel 2 (debug) a wait() that has not
  // returned half of it after its collective completed is reported.
  CollectiveExecutor(int rank, int size, std::string groupName, int logLevel, std::chrono::milliseconds stallBound,
                     std::shared_ptr<Transport> transport, Comm& comm, std::shared_ptr<ArrivalBoard> arrivals,
                     std::shared_ptr<DumpSignal> dumps, std::shared_ptr<GroupFailure> failure,
                     std::shared_ptr<FlightRecorder> recorder);
  ~CollectiveExecutor();

  // Queues `body`; the returned work completes with `outputs`. Every message of the call carries
  // its signature, which every rank must agree on. `device`: the call's device side, or null.
  // `mayRunHere`: the caller waits for the work at once, so the job may run on its thread when
  // nothing is queued or running (never for a device call, whose stream the worker owns).
  c10::intrusive_ptr<c10d::Work> enqueue(const CallDescription& call, std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs, std::chrono::milliseconds timeout, Body body,
                                         std::shared_ptr<DeviceCall> device, bool mayRunHere);
  // Runs `body` on this thread as the group's next collective, with no Work, when nothing is
  // queued or running, and raises its error; false otherwise, with nothing run and `body` left
  // to the caller (to queue it instead).
  bool runHereIfIdle(const CallDescription& call, std::chrono::milliseconds timeout, Body& body);
  // How many collectives were issued.
  uint64_t issued();
  // Whether no collective is queued or running.
  bool idle();
  // Ends the worker once the queue is empty; with abortPending, fails queued jobs first.
  void stop(bool abortPending);
  // The group is being aborted: a failure from now on reads nothing from the store.
  void markAborting() {
    aborting_.store(true);
  }
  // Writes the flight recorder's ring; its path, or empty when it is off.
  std::string dumpTrace(const std::string& reason);

 private:
  struct Job {
    c10::intrusive_ptr<TorusWork> work; // null for runHereIfIdle's calls
    // The collective's place in the order jobs run in, the same on every rank, which tags its
    // messages; 0 until it starts.
    uint64_t seq;
    // Where it goes in the queue, which is kept in this order.
    CallPlace place;
    const char* title;
    std::chrono::milliseconds timeout;
    CallSignature call;
    Body body;
    std::shared_ptr<DeviceCall> device;
    // The device call's scope (its stream current), from enter() until the work is completed.
    std::shared_ptr<void> deviceScope;
    // Its entry in the flight recorder, and whether that entry was written as started already
    // (a call run at once by the thread that issued it).
    uint64_t recordId = 0;
    bool recordedStarted = false;
  };
  // A job's failure: the error its work gets, and the text the group records and its peers are
  // told.
  struct JobFailure {
    std::exception_ptr error;
    std::string text;
  };
  void runWorker();
  // Runs one job and completes or fails its work; on the worker, or on the calling thread.
  void execute(Job& job);
  // Completes or fails the job's work with `error`; its future's callbacks run here.
  void finish(Job& job, std::exception_ptr error);
  // On the worker: execute(), its future's callbacks run inside a CallbackScope of this executor.
  void executeWithCallbacks(Job& job);
  // With mutex_ held: queues `job` at its place.
  void insert(Job job);
  // The call's signature, with where it was issued from.
  static CallSignature signatureOf(const CallDescription& call);
  // On the worker in callbacks: runs queued jobs in order, up to `place`, until `target` (if
  // any) has run or was failed off the queue.
  void drainThrough(const CallPlace& place, const TorusWork* target);
  // After a job ran from inside callbacks: the group moved, so a stall starts anew.
  void ranInCallbacks();
  // With mutex_ held: the queue waits while the worker is in callbacks, from now on.
  void noteStall();
  // The stall watch's thread: fails the group once the queue has not moved for the head job's
  // timeout while the worker was in callbacks.
  void watchStalls();
  // With mutex_ held (released meanwhile): fails the group and every queued job.
  void failStalled(std::unique_lock<std::mutex>& lock);
  // Fails the works of jobs taken off the queue, never started, with `error`.
  void failQueued(std::deque<Job>& jobs, const CommError& error);
  // Runs one job; the error its caller gets, or null.
  std::exception_ptr attempt(Job& job);
  // With mutex_ held: makes the calling thread the runner when nothing is queued or running.
  bool claimIfIdle();
  // After a job ran on a calling thread: the worker takes calls queued meanwhile.
  void releaseCallingThread();
  // Runs one job (a device job inside its device scope, which it enters first); the error for its
  // work, or null when it succeeded.
  std::exception_ptr run(Job& job);
  // A device job's stall, with what the ready event says: the caller's stream may never have
  // reached the point the collective was issued at.
  static std::exception_ptr withReadyEvent(const Job& job, std::exception_ptr raised);
  // "torus:all_reduce:ring #7 (rank 0 of 4, group '0')"
  std::string contextOf(const Job& job) const;
  // Fails the running job for `raised`, once: aborts the transport and asks the peers to dump,
  // then reads who was missing (bounded), dumps and records the failure for the group. From the
  // job's thread (run's catch, or an algorithm through Comm::fail).
  void failRunning(std::exception_ptr raised);
  // `raised` as the transport's failure (a peer's death, a timeout, an abort), if it is one and
  // not a mismatch.
  static std::optional<CommError> transportFailure(std::exception_ptr raised);
  // Whether `error` is the collective's own timeout (not a device phase's stall).
  static bool ownTimeout(const CommError& error);
  // The running job's failure; `missing`: who had not arrived, `note`: said after
  // a transport failure's text (where the flight recorder's dump went).
  JobFailure failureOf(std::exception_ptr raised, const std::string& missing, const std::string& note) const;
  // The flight recorder's entry of a call; 0 when it is off.
  uint64_t record(const CallDescription& call, const char* title, const std::vector<at::Tensor>& inputs,
                  const std::vector<at::Tensor>& outputs, uint64_t startedAs);
  // With mutex_ held, by the thread that claimed the executor: the number its next job runs as.
  uint64_t nextSeqOfClaimer() const;
  // The text of a transport's failure, naming both sides of a mismatch, or a timeout's length and
  // the absent ranks (`missing`, where known).
  std::string explain(const CommError& error, std::chrono::milliseconds timeout, const std::string& missing) const;

  const int rank_;
  const std::shared_ptr<const GroupLabel> label_;
  const int logLevel_;
  std::shared_ptr<Transport> transport_;
  Comm& comm_;
  std::shared_ptr<ArrivalBoard> arrivals_;
  std::shared_ptr<DumpSignal> dumps_;
  std::shared_ptr<GroupFailure> failure_;
  std::shared_ptr<FlightRecorder> recorder_;
  // Debug mode only.
  std::shared_ptr<WaitWatch> watch_;

  std::mutex mutex_;
  std::condition_variable queueChanged_;
  std::deque<Job> queue_;
  uint64_t issued_ = 0;
  // Jobs started: only the one runner (busy_, or the worker in callbacks) counts.
  uint64_t started_ = 0;
  bool stopping_ = false;
  std::atomic<bool> aborting_{false};
  // A job runs, on the worker or a calling thread; the one runner of the group's Comm.
  bool busy_ = false;
  // The worker's last calls by sequence number, to describe a mismatch found a few calls late.
  std::array<std::pair<uint64_t, CallSignature>, 16> recentCalls_{};
  // The job the worker runs, and its failure once it has one.
  const Job* running_ = nullptr;
  std::optional<JobFailure> runningFailure_;
  // The jobs whose callbacks the worker is in (outermost first); since when the queue has waited
  // for them, with nothing run meanwhile.
  std::vector<std::pair<uint64_t, const char*>> completing_;
  Clock::time_point completingSince_;
  std::optional<Clock::time_point> stalledSince_;
  std::condition_variable stallChanged_;
  std::thread stallWatch_; // started at the first stall
  std::thread worker_;
};

} // namespace torus
