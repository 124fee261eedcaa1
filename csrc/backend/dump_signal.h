// DumpSignal: when one rank of a group fails, every live rank writes its flight recorder's dump,
// also a rank that is asleep in Python, in a data loader or computing, with no collective running:
// it is the rank the user needs to see. The failing rank sets every other rank's key
// (torus/dump/<rank>) in one batched store write, on a thread of its own that nobody waits for;
// each rank has a thread that waits for its own key and dumps, with its threads' Python stacks,
// when it is set.
//
// The wait costs the store nothing while nothing fails: on a TCPStore (or a HashStore) it is one
// blocking wait on a connection of its own, which the server answers when the key is set; on a
// FileStore, whose waits read the file every 10 ms, the key is checked once a second instead.
// Stores of other kinds (written in Python) get no waiter, as a call into Python from this thread
// could meet an interpreter that is shutting down: their ranks dump when they fail themselves.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/bounded_thread.h"
#include "backend/flight_recorder.h"

namespace torus {

class DumpSignal {
 public:
  DumpSignal(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             std::shared_ptr<FlightRecorder> recorder);
  ~DumpSignal();
  DumpSignal(const DumpSignal&) = delete;
  DumpSignal& operator=(const DumpSignal&) = delete;

  // Asks every other rank to dump, saying `why`; once per group, without waiting for the store.
  void raise(const std::string& why);
  // Ends the waiter (its wait is woken by setting its key, on a thread nobody waits for); waits
  // for it at most `patience`. Idempotent.
  void stop(std::chrono::milliseconds patience);

  struct Waiter;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  std::shared_ptr<Waiter> waiter_; // null: no waiter for this store
  BoundedThread waiting_; // holds the waiter
  std::atomic<bool> raised_{false};
};

} // namespace torus
