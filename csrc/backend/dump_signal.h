// DumpSignal: when one rank of a group fails, every live rank writes its flight recorder's dump,
// also a rank that is asleep in Python, in a data loader or computing, with no collective running:
// it is the rank the user needs to see. The failing rank sets every other rank's key
// (torus/dump/<rank>) in one batched store write, on a thread of its own that nobody waits for;
// each rank has a thread that waits for its own key and dumps, with its threads' Python stacks,
// when it is set.
//
// The wait costs the store nothing while nothing fails: on a TCPStore (or a HashStore) it is one
// blocking pop of a queue of its own, on a connection of its own, which the server answers with
// the request itself (a waiter never reads the store after it woke); on a FileStore, whose waits
// read the file every 10 ms, the key is checked once a second instead. The first rank that
// destroys the group (or whose process ends with it) ends every rank's wait, so that a store
// living in a rank's process never closes under open pops; a failure after that is dumped by the
// ranks it reaches, not by sleeping ones.
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
  // How the waiters wait: a blocking pop of a queue, a check every second, or not at all.
  enum class WaitKind { kNone, kQueue, kPolling };

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  const WaitKind kind_;
  std::shared_ptr<Waiter> waiter_; // null: no waiter for this store
  BoundedThread waiting_; // holds the waiter
  std::atomic<bool> raised_{false};
};

} // namespace torus
