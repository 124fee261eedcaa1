// What collectives on device memory (GPU tensors) need, without naming the device's API: a
// DevicePath moves and combines this rank's device bytes on the call's stream, and DeviceArenas
// map the device memory of the ranks on this host into this process.
//
// Knows nothing of CUDA or torch: the algorithms in collectives/device/ are written against these
// interfaces alone (the backend's CUDA build implements them in backend/cuda/), so they compile
// in every build.
#pragma once

#include <cstddef>
#include <memory>
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
  // Returns once everything enqueued so far has completed; CommError (kTimeout) naming the
  // device when the deadline passes first.
  virtual void synchronize(Deadline deadline) = 0;
  // At least nbytes of staging memory for `use`: one buffer per use and device, reused by later
  // calls so that no call allocates pinned memory once warm. It keeps what it holds until a call
  // asks for more than it has (then it grows, and its contents are lost).
  virtual char* staging(StagingUse use, size_t nbytes) = 0;
};

// The device memory of the ranks of a group that share this host, one arena per rank, each
// mapped into every one of them (CUDA IPC): a rank copies into its own arena, and reads its
// peers' arenas directly.
class DeviceArenas {
 public:
  virtual ~DeviceArenas() = default;
  // Each arena's size in bytes, the same on every rank.
  virtual size_t bytes() const = 0;
  // The arena of a transport rank, mapped into this process; nullptr when it is not (another
  // host, or a peer whose memory cannot be mapped here). The same answers on every rank of the
  // group, so that ranks agree on which algorithms can use arenas.
  virtual char* arena(int transportRank) const = 0;
};

// The arenas of a Comm's ranks, numbered as the Comm numbers them.
struct ArenaView {
  std::vector<char*> arenas;
  size_t bytes = 0;
};

} // namespace torus
