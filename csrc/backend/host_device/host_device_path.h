// HostDevicePath: the host device layer's DevicePath, a "device" whose memory is CPU memory.
// Copies are memcpy, reductions the CPU reducer's, staging plain 64-byte-aligned buffers (filled
// with 0xff when allocated, so that reading what the contract calls lost shows). Eager: every
// operation runs when enqueued, as a device that keeps up would run it (the backend's mode:
// torch ops of the job run at once on the worker, in order with the path's). Deferred:
// operations queue until synchronize() (or a staging buffer grows), the latest a stream may run
// them; an algorithm that reads what it enqueued before synchronizing, or signals peers before its
// copies landed, then sees stale bytes.
//
// Checked (once setRegions has been called, as tests do): every operation's ranges against the
// regions of the call in progress and the staging buffers: a range must lie inside one region, a
// destination must not be a peer's arena, a copy's ranges must not overlap, and a reduction's
// destination may be one of its sources but must not overlap one partially. A violation throws
// std::logic_error at once, naming it.
//
// A stall fault (HostDeviceFault) makes every synchronize() of a matching phase wait out its
// bound and fail as a stuck device would.
#pragma once

#include <array>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

// A fault the host layer plays, for tests of the stall bounds and of failures (TORUS_HOST_DEVICE).
struct HostDeviceFault {
  enum class Kind : uint8_t { kNone, kStall, kFail };
  Kind kind = Kind::kNone;
  std::string step;

  // "on" -> none; "stall:<step>"; "fail:enter". Raises naming TORUS_HOST_DEVICE otherwise.
  static HostDeviceFault parse(const std::string& setting);
  bool stalls(const char* phaseStep) const;
};

// What memory a collective may touch, by kind: its buffer ("device memory"), its own arena
// (written by copies into it, read by every rank of its host), a peer's arena (read only), or the
// path's staging.
enum class RegionKind : uint8_t { kDevice, kOwnArena, kPeerArena, kStaging };

struct Region {
  const char* begin;
  size_t bytes;
  RegionKind kind;
  std::string name;

  bool holds(const void* p, size_t nbytes) const;
};

struct PathStats {
  uint64_t copies = 0;
  uint64_t reduces = 0;
  uint64_t synchronizes = 0;
  uint64_t stagingAllocations = 0;
  uint64_t arenaBytesWritten = 0; // copied or reduced into this rank's arena
  uint64_t arenaBytesRead = 0; // read from any arena (copy source, reduce source)
  uint64_t stagingBytes = 0; // copied into or out of staging, or read from it by a reduction
};

class HostDevicePath : public DevicePath {
 public:
  HostDevicePath(bool deferred, std::chrono::milliseconds stallBound, HostDeviceFault fault = {});
  ~HostDevicePath() override;
  HostDevicePath(const HostDevicePath&) = delete;
  HostDevicePath& operator=(const HostDevicePath&) = delete;

  void copy(void* dst, const void* src, size_t nbytes) override;
  void reduce(const DeviceReduction& op, void* dst, const void* const* srcs, int numSources, size_t count) override;
  void synchronize(Deadline deadline, const DevicePhase& phase) override;
  std::chrono::milliseconds stallBound() const override {
    return stallBound_;
  }
  char* staging(StagingUse use, size_t nbytes, Deadline deadline) override;

  // The memory the call in progress may touch besides staging; from the first call on, every
  // operation is checked.
  void setRegions(std::vector<Region> regions);
  // Runs what is queued (deferred), as a stream synchronization would.
  void flush();
  // Drops what is queued: after a failed call, whose buffers may be gone.
  void discard();

  const PathStats& stats() const {
    return stats_;
  }
  void resetStats() {
    stats_ = PathStats{};
  }

 private:
  struct Buffer {
    char* data = nullptr;
    size_t bytes = 0;
  };

  void run(std::function<void()> operation);
  RegionKind classify(const void* p, size_t nbytes, const char* what, bool write) const;
  void account(RegionKind kind, size_t nbytes, bool write);

  const bool deferred_;
  const std::chrono::milliseconds stallBound_;
  const HostDeviceFault fault_;
  bool checked_ = false;
  std::array<Buffer, 2> staging_{};
  std::vector<Region> regions_;
  std::vector<Region> stagingRegions_;
  std::vector<std::function<void()>> queue_;
  Scratch temporary_;
  PathStats stats_;
};

// Waits, as a stuck device would, until `bound`, then throws CommError (kTimeout) saying that
// `what` did not complete within the stall bound.
[[noreturn]] void stallUntil(Deadline bound, const std::string& what, std::chrono::milliseconds stallBound);

} // namespace torus
