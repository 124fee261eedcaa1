// Which ranks reached a collective: what a timeout error needs to name the rank that never came.
//
// A rank blocked in a ring or a tree waits for its neighbour, which may itself wait for the rank
// that is missing; the neighbour is the wrong rank to blame. So a rank that has been inside
// collective #N for a while (a quarter of its timeout, at most a second) writes N to the group's
// store under its rank; a rank that times out in #N reads every rank's number, and those below N
// had not reached it. Fast collectives never touch the store: only slow ones pay a store write.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace torus {

class ArrivalBoard {
 public:
  ArrivalBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size);
  ~ArrivalBoard();
  ArrivalBoard(const ArrivalBoard&) = delete;
  ArrivalBoard& operator=(const ArrivalBoard&) = delete;

  // The worker thread entered collective `seq`, which may wait up to `timeout`.
  void entered(uint64_t seq, std::chrono::milliseconds timeout);
  // ... and left it.
  void left();
  // Ends the thread (shutdown, abort); later calls publish nothing. Idempotent.
  void stop();
  // Ranks other than this one that had not been seen inside collective `seq` or a later one;
  // nothing when the store cannot be read.
  std::optional<std::vector<int>> notReached(uint64_t seq) const;

 private:
  void run();
  std::string keyOf(int rank) const;

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t current_ = 0; // the collective the worker is in; 0 between collectives
  std::chrono::steady_clock::time_point publishAt_;
  bool stopping_ = false;
  std::thread thread_;
};

// "rank 2 had not reached all_reduce #5" / "ranks 2, 7 had not ..." / "every rank had reached ...".
std::string describeNotReached(const std::vector<int>& ranks, const std::string& collective);

} // namespace torus
