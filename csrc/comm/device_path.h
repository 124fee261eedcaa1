// What collectives on device memory (GPU tensors) need, without naming the device's API: a
// DevicePath moves and combines this rank's device bytes on the call's stream, and DeviceArenas
// map the device memory of the ranks on this host into this process.
//
// Knows nothing of CUDA or torch: the algorithms in collectives/device/ are written against these
// interfaces alone (the backend's CUDA build implements them in backend/cuda/), so they compile
// in every build.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reduce/reduce.h"
#include "transport/transport.h"

namespace torus {

// Host memory the device reads and writes directly (pinned and mapped): what the staged
// algorithms send from and receive into.
enum class StagingUse : uint8_t {
  kMirror, // a host copy of a whole device buffer
  kSlots, // the landing slots of received chunks
};

// A reduction as the device computes it: the dtype and op of the CPU reducer's.
struct DeviceReduction {
  DataType dtype;
  ReduceKind kind;
};

// Where a device collective is, for the error of a stall: the step, the round of an arena
// collective (-1: none) and the peer it concerns (a Comm rank; -1: none).
struct DevicePhase {
  const char* step;
  int64_t round = -1;
  int peer = -1;

  // "arena copy, round 3" / "staged reduce of the chunk from rank 2"
  std::string describe() const;
};

class DevicePath {
 public:
  virtual ~DevicePath() = default;

  // Enqueues a copy of nbytes from src to dst on the call's stream: device or staging memory,
  // either way, or another rank's arena.
  virtual void copy(void* dst, const void* src, size_t nbytes) = 0;
  // Enqueues dst[i] = srcs[0][i] (op) ... (op) srcs[numSources - 1][i] for i in [0, count) on the
  // call's stream, with the semantics of the CPU reducer; dst may be one of the sources. Sources
  // may be device, staging or arena memory.
  virtual void reduce(const DeviceReduction& op, void* dst, const void* const* srcs, int numSources,
                      size_t count) = 0;
  // Returns once everything enqueued so far has completed. CommError (kTimeout) naming the
  // device and `phase` when the deadline, or the stall bound counted from now, passes first.
  virtual void synchronize(Deadline deadline, const DevicePhase& phase) = 0;
  // How long one phase of a device collective may wait for the device or for its peers
  // (TORUS_DEVICE_STALL_TIMEOUT).
  virtual std::chrono::milliseconds stallBound() const = 0;
  // At least nbytes of staging memory for `use`: one buffer per use and device, reused by later
  // calls so that no call allocates pinned memory once warm. It keeps what it holds until a call
  // asks for more than it has (then it grows, and its contents are lost, once the work that may
  // still use them has completed, waited for until `deadline`).
  virtual char* staging(StagingUse use, size_t nbytes, Deadline deadline) = 0;
};

// How every stall's error starts: the executor then does not add the collective's timeout to it.
inline constexpr const char* kStalledIn = "stalled in ";

// The stall bound's deadline for a phase starting now, within the collective's `deadline`.
inline Deadline phaseDeadline(const DevicePath& path, Deadline deadline) {
  return std::min(deadline, Clock::now() + path.stallBound());
}

// The device memory of the ranks of a group that share this host, one arena per rank, each
// mapped into every one of them (CUDA IPC): a rank copies into its own arena, and reads its
// peers' arenas directly.
class DeviceArenas {
 public:
  virtual ~DeviceArenas() = default;
  // Each arena's size in bytes, the same on every rank.
  virtual size_t bytes() const = 0;
  // The arena of a transport rank, mapped into this process; nullptr when it is not: another
  // host, a rank that could not map all of its host peers' arenas (every rank of the group then
  // answers nullptr for it), or, on such a rank, every rank. The answers differ from rank to
  // rank, but they agree where it matters: a Comm has arenas on all of its ranks (Comm::
  // deviceArenas) or on none, so its ranks take the same route.
  virtual char* arena(int transportRank) const = 0;
};

// The arenas of a Comm's ranks, numbered as the Comm numbers them.
struct ArenaView {
  std::vector<char*> arenas;
  size_t bytes = 0;
};

} // namespace torus
