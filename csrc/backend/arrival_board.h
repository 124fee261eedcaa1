// Which ranks reached a collective: what a timeout error needs to name the rank that never came.
//
// A rank blocked in a ring or a tree waits for its neighbour, which may itself wait for the rank
// that is missing; the neighbour is the wrong rank to blame. So a rank that has been inside
// collective #N for a while (a quarter of its timeout, at most 250 ms) writes N to the group's
// store under its rank; a rank that times out in #N (the group's timeout or a Work.wait's) reads
// every rank's number in one batched read, and those below N had not reached it. Fast
// collectives never touch the store: only slow ones pay a store write, small beside a collective
// that takes 250 ms. Every store call here has a deadline of its own (store_within.h): a frozen
// store delays neither a failure nor stop().
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/bounded_thread.h"

namespace torus {

class ArrivalBoard : public std::enable_shared_from_this<ArrivalBoard> {
 public:
  // Publishes this rank's arrival at 0 and starts the thread, which holds the board until it ends
  // (a thread still in a frozen store's call outlives the group harmlessly).
  static std::shared_ptr<ArrivalBoard> create(c10::intrusive_ptr<c10d::Store> store, int rank, int size);
  ArrivalBoard(const ArrivalBoard&) = delete;
  ArrivalBoard& operator=(const ArrivalBoard&) = delete;

  // The worker thread entered collective `seq`, which may wait up to `timeout`.
  void entered(uint64_t seq, std::chrono::milliseconds timeout);
  // ... and left it.
  void left();
  // The collective the worker is in; 0 between collectives.
  uint64_t current() const;
  // Ends the thread (shutdown, abort); later calls publish nothing. Waits for it at most
  // `patience` (a thread in a store call ends when the call's deadline passes). Idempotent.
  void stop(std::chrono::milliseconds patience);
  // "rank 2 had not reached #5": the ranks other than this one not seen inside collective `seq`
  // or a later one. Empty when that cannot be told: this rank has not published `seq` yet (then
  // the others, on the same delay, may not have either). When the store does not answer within
  // its deadline, says so.
  std::string describeMissing(uint64_t seq) const;

 private:
  ArrivalBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size);
  void run();
  std::string keyOf(int rank) const;

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t current_ = 0; // the collective the worker is in; 0 between collectives
  uint64_t published_ = 0; // the last collective this rank wrote to the store
  std::chrono::steady_clock::time_point publishAt_;
  std::chrono::steady_clock::time_point wakeAt_{}; // when the thread looks next; the epoch before it first waits
  bool stopping_ = false;
  BoundedThread thread_; // holds the board: left behind in a frozen store's call, it ends later
};

} // namespace torus
