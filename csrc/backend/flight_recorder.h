// FlightRecorder: the group's last N collectives and point-to-point calls (TORUS_TRACE_BUFFER),
// each with what it was, who issued it and how far it got, written as JSON when a collective
// times out or fails, when the group is aborted, or on request (torch_torus.dump_trace()), so
// that `python -m torch_torus.trace DIR` can say which rank never reached which collective.
// Field names follow torch's flight recorder where it has one (record_id, collective_seq_id,
// profiling_name, input_sizes, state, time_created_ns, ...).
//
// Recording is cheap enough for every call (BENCHMARKS.md): a ring of fixed-size entries, reused,
// that hold ids, enums and the shapes inline (a call of more than kInlineTensors tensors or
// kInlineDims dimensions a side keeps them beside, under a lock); one read of the CPU's time-stamp
// counter per state change (torch's profiler's clock), turned into times since the epoch at the
// dump; no lock. Each entry has a version: a writer makes it odd while it writes (one writer at a
// time per entry), and the dump copies an entry and keeps the copy only if the version was even
// and unchanged. Strings are built at the dump; a failure's text is kept beside, under a lock.
//
// Each entry says what every rank must agree on, as the runtime compares it (the reduction and
// the size from CallDescription, 0 where sizes may differ by rank), so that the analyzer never
// takes shapes that differ by design for a mismatch. A dump holds the Python stacks of the
// process's threads (from the provider the Python module sets), so that a rank that was not in a
// collective shows where it was.
//
// Dumps cannot be lost or planted: one dump at a time per recorder, written under a name of its
// own and renamed into place; every directory on the way that the recorder creates is 0700, an
// existing one must be a directory of this user (not a link), and the file is opened without
// following links.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/ApproximateClock.h>

namespace torus {

class FlightRecorder {
 public:
  // `capacity` 0: records nothing. Dumps go to `dir`/rank<rank>.json.
  FlightRecorder(size_t capacity, std::string dir, int rank, int size, std::string groupName);

  struct Call {
    const char* profilingName; // lives forever (CallDescription::title)
    bool p2p = false;
    at::ScalarType dtype = at::kByte;
    int rootOrPeer = -1;
    bool fromCallback = false;
    const char* reduceOp = nullptr; // lives forever (reduceOpName); null: no reduction
    uint64_t agreedBytes = 0; // CallDescription::nbytes: 0 where sizes may differ by rank
  };
  bool enabled() const {
    return capacity_ != 0;
  }
  // The record's id; 0 when off. `startedAs` non-zero: the call starts now, as collective (or
  // point-to-point call) number `startedAs`, so that one write of the entry does both.
  uint64_t record(const Call& call, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                  uint64_t startedAs = 0);
  // The record started as collective (or point-to-point call) number `seq`.
  void started(uint64_t id, uint64_t seq);
  // Completed, or failed with `error` (non-empty).
  void finished(uint64_t id, const std::string& error);
  // Writes the ring (newest last) and returns the file's path, or an empty string when off or
  // the file cannot be written (the reason then goes to stderr). `waitingFor`: what the running
  // collective waits for ("ranks 3 had not arrived"), for its entry.
  std::string dump(const std::string& reason, const std::string& waitingFor);
  // What an error says of a dump written to `path` (nothing when none was).
  static std::string errorNote(const std::string& path);
  // Whether a call of this rank failed (and so dumped, or is about to).
  bool hasFailure() const {
    return hasFailure_.load(std::memory_order_acquire);
  }
  // Where a dump gets the process's threads' Python stacks (faulthandler's text), set once by the
  // Python module; without one, dumps hold none.
  using StackProvider = std::string (*)();
  static void setStackProvider(StackProvider provider);
  // While alive, dumps written on this thread hold `stacks` instead of the provider's: stacks read
  // while this thread held the GIL (torch_torus.dump_trace), with this thread as the current one.
  // Called without the GIL, the provider has a thread of its own wait for it.
  class PresetStacks {
   public:
    explicit PresetStacks(std::string stacks);
    ~PresetStacks();
    PresetStacks(const PresetStacks&) = delete;
    PresetStacks& operator=(const PresetStacks&) = delete;

   private:
    std::string stacks_;
    const std::string* prior_;
  };

  static constexpr size_t kInlineTensors = 4;
  static constexpr size_t kInlineDims = 4;

 private:
  enum class State : uint8_t { kScheduled, kStarted, kCompleted, kFailed };
  // One side's shapes: how many tensors, each one's number of dimensions (4 bits each) and the
  // dimensions back to back, 32 bits each (a larger one spills); `spilled`: kept in Spill instead.
  struct InlineShapes {
    std::atomic<uint64_t> layout{0}; // count | ranks << 8 | spilled << 40
    std::array<std::atomic<int32_t>, kInlineDims> dims{};
  };
  // Every field is atomic (read relaxed under the version), so that the dump may copy an entry
  // while a writer changes it. Two cache lines: the ring of 2000 entries is 256 KiB.
  struct alignas(64) Entry {
    std::atomic<uint64_t> version{0};
    std::atomic<uint64_t> id{0};
    std::atomic<uint64_t> seq{0};
    std::atomic<const char*> title{nullptr};
    std::atomic<uint64_t> call{0}; // dtype | p2p << 8 | fromCallback << 9 | state << 10 | rootOrPeer << 32
    // c10::getApproximateTime(); 0: not yet.
    std::atomic<uint64_t> created{0};
    std::atomic<uint64_t> started{0};
    std::atomic<uint64_t> completed{0};
    InlineShapes inputs;
    InlineShapes outputs;
    std::atomic<const char*> reduceOp{nullptr};
    std::atomic<uint64_t> agreedBytes{0};
  };
  static_assert(sizeof(Entry) == 128, "an entry is two cache lines");
  // A plain copy of an entry, for the dump.
  struct Snapshot {
    uint64_t id;
    uint64_t seq;
    const char* title;
    uint64_t call;
    uint64_t created, started, completed;
    const char* reduceOp;
    uint64_t agreedBytes;
    std::vector<std::vector<int64_t>> inputs, outputs;
  };
  // The shapes of a call that do not fit inline, by record id.
  struct Spill {
    uint64_t id;
    std::vector<std::vector<int64_t>> inputs, outputs;
  };

  // Takes `entry` for writing (waits while another writer has it); returns the version to pass
  // to release().
  static uint64_t acquire(Entry& entry);
  static void release(Entry& entry, uint64_t version);
  // Stores `tensors`' shapes inline; false when they do not fit.
  static bool storeInline(const std::vector<at::Tensor>& tensors, InlineShapes& into);
  static std::vector<std::vector<int64_t>> loadInline(const InlineShapes& from);
  // Copies the entry of record `id`; false when it was overwritten or is being written.
  bool snapshot(uint64_t id, Snapshot& out);
  void spill(uint64_t id, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);
  // Sets the state of record `id` (and its time `field` to now) if its entry still holds it.
  void advance(uint64_t id, State state, std::atomic<uint64_t> Entry::*field, uint64_t seq);
  // The file this rank's dump is.
  std::string dumpPath() const;
  // The dump's JSON.
  std::string render(const std::string& reason, const std::string& waitingFor);

  const size_t capacity_;
  const std::string dir_;
  const int rank_;
  const int size_;
  const std::string groupName_;
  std::unique_ptr<Entry[]> ring_;
  std::atomic<uint64_t> nextId_{1};
  // Turns the entries' times into times since the epoch (null when off).
  std::unique_ptr<c10::ApproximateClockToUnixTimeConverter> clock_;
  // The rare: spilled shapes and failures' texts, the last `capacity_` of each.
  std::mutex asideMutex_;
  std::deque<Spill> spills_;
  std::deque<std::pair<uint64_t, std::string>> errors_;
  std::atomic<bool> hasFailure_{false};
  // One dump at a time: the worker's failure, an aborting thread and a peer's request may meet.
  std::mutex dumpMutex_;
  uint64_t dumpsWritten_ = 0; // under dumpMutex_: names each dump's temporary file
};

} // namespace torus
