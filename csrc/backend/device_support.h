// The backend's device side: how a call on device (CUDA) tensors is ordered with the caller's
// streams, NCCL's and gloo's stream semantics:
//   - on the calling thread, the call records an event on the tensors' current stream; the
//     group's communication stream for that device waits on it, so the collective sees the
//     caller's pending writes without blocking the host; the tensors are marked as used by the
//     communication stream, so the caching allocator does not reuse them early;
//   - the job runs on the worker with the communication stream current (torch ops in it, such as
//     PREMUL_SUM's scaling, are queued there) and records a done event after its last device
//     operation;
//   - Work.wait() makes the caller's current stream wait on that event; the work's future is
//     CUDA-aware (completed on the communication stream, so get_future() and callbacks see the
//     data on their current streams); is_completed() is the job done and the event reached.
// Built without CUDA, a device tensor gets an error naming it.
//
// Two implementations: CUDA (backend/cuda/, when the build has CUDA) and the host one
// (backend/host_device/: "device memory" is CPU memory, arenas POSIX shared memory), which
// TORUS_HOST_DEVICE turns on for CPU tensors so that every line of this control path runs on a
// machine without a GPU. Nothing here may take torch's Work lock: TorusWork calls
// blockCurrentStream() from synchronize(), which torch calls with that lock held.
//
// Knows no CUDA header.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

// Each rank's device arena: two halves of 16 MiB, one round of an arena collective each.
constexpr size_t kArenaBytes = size_t(32) << 20;

// What a group's device side is told at creation.
struct DeviceOptions {
  int rank = 0;
  // Each rank's host index (TorusConfig::hosts; empty: one host).
  std::vector<int> hosts;
  int logLevel = 0;
  // How long one phase of a device collective may wait (TORUS_DEVICE_STALL_TIMEOUT).
  std::chrono::milliseconds stallBound{30000};
  // TORUS_HOST_DEVICE: "off", or CPU tensors run through the host device layer: "on", or "on"
  // with a fault for tests, "stall:<step>" (a phase whose step names contain <step>, or
  // "ready" / "done", never completes) or "fail:enter".
  std::string hostDevice = "off";
};

class DeviceCall {
 public:
  virtual ~DeviceCall() = default;

  // The device the call's tensors live on.
  virtual c10::Device device() const = 0;
  // The devices the work's future is aware of (empty: a CPU future).
  virtual std::vector<c10::Device> futureDevices() const = 0;
  // The path that moves and combines the call's device bytes, on the communication stream.
  virtual DevicePath& path() = 0;

  // Worker: for the scope of the returned object, the communication stream is this thread's
  // current stream, ordered after the caller's pending writes.
  virtual std::shared_ptr<void> enter() = 0;
  // Worker, inside enter()'s scope, after the job's last device operation.
  virtual void recordDone() = 0;
  // Worker: attaches the device arenas of the group's ranks on this host to `comm` (the group's
  // Comm), setting them up at the group's first call on this device: a collective step, which
  // every rank takes at the same call.
  virtual void attachArenas(Comm& comm) = 0;

  // Caller: the current stream waits for the job's device work (after the job is done on the
  // host). A wait on the host is bounded by the stall bound (CommError naming the done event).
  virtual void blockCurrentStream() = 0;
  // Whether the job's device work has completed.
  virtual bool deviceDone() = 0;
  // Whether the caller's stream has reached the point the call was issued at: what a stall's
  // error says when it has not (the collective then waits for work queued before it).
  virtual bool readyReached() = 0;
};

class DeviceSupport {
 public:
  virtual ~DeviceSupport() = default;

  // The group's device side.
  static std::unique_ptr<DeviceSupport> create(const DeviceOptions& options);

  // Whether CPU tensors run through a device layer (the host one): entry points then stage them
  // as they stage device tensors.
  virtual bool stagesCpuTensors() const {
    return false;
  }

  // Calling thread: nullptr when every tensor is on the CPU (unless the host device layer is on);
  // else the call's device side, ordered after the current stream of the tensors' device. Raises
  // naming `collective` when tensors sit on different devices, or when this build has no CUDA path.
  virtual std::shared_ptr<DeviceCall> begin(const std::vector<at::Tensor>& outputs,
                                            const std::vector<at::Tensor>& inputs, const char* collective) = 0;
};

// The one device of a call's tensors: CPU when all are; raises naming `collective` when some
// differ. Used by every DeviceSupport.
c10::Device deviceOfCall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                         const char* collective);

} // namespace torus
