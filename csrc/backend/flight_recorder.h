// FlightRecorder: the group's last N collectives and point-to-point calls (TORUS_TRACE_BUFFER),
// each with what it was, who issued it and how far it got, written as JSON when a collective
// times out or fails, when the group is aborted, or on request (torch_torus.dump_trace()), so
// that `python -m torch_torus.trace DIR` can say which rank never reached which collective.
// Field names follow torch's flight recorder where it has one (record_id, collective_seq_id,
// profiling_name, input_sizes, state, time_created_ns, ...).
//
// Recording is a short critical section per state change and no allocation beyond the shapes:
// the ring's entries are reused.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace torus {

class FlightRecorder {
 public:
  // `capacity` 0: records nothing. Dumps go to `dir`/rank<rank>.json.
  FlightRecorder(size_t capacity, std::string dir, int rank, int size, std::string groupName);

  struct Call {
    const char* profilingName;
    bool p2p = false;
    at::ScalarType dtype = at::kByte;
    int rootOrPeer = -1;
    bool fromCallback = false;
  };
  bool enabled() const {
    return capacity_ != 0;
  }
  // The record's id; 0 when off. The shapes are copied into the ring's reused entry: no
  // allocation once the ring has gone round.
  uint64_t record(const Call& call, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);
  // The record started as collective (or point-to-point call) number `seq`.
  void started(uint64_t id, uint64_t seq);
  // Completed, or failed with `error` (non-empty).
  void finished(uint64_t id, const std::string& error);
  // Writes the ring (newest last) and returns the file's path, or an empty string when off or
  // the file cannot be written (the reason then goes to stderr). `waitingFor`: what the running
  // collective waits for ("ranks 3 had not arrived"), for its entry.
  std::string dump(const std::string& reason, const std::string& waitingFor);
  // Where dumps go.
  const std::string& directory() const {
    return dir_;
  }

 private:
  enum class State { kScheduled, kStarted, kCompleted, kFailed };
  struct Entry {
    uint64_t id = 0;
    uint64_t seq = 0;
    Call call;
    std::vector<std::vector<int64_t>> inputSizes;
    std::vector<std::vector<int64_t>> outputSizes;
    State state = State::kScheduled;
    int64_t createdNs = 0;
    int64_t startedNs = 0;
    int64_t completedNs = 0;
    std::string error;
  };
  Entry* find(uint64_t id);

  const size_t capacity_;
  const std::string dir_;
  const int rank_;
  const int size_;
  const std::string groupName_;
  std::mutex mutex_;
  std::vector<Entry> ring_;
  uint64_t nextId_ = 1;
};

} // namespace torus
