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
// Knows no CUDA header: backend/cuda/ implements it when the build has CUDA.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

class DeviceCall {
 public:
  virtual ~DeviceCall() = default;

  // The device the call's tensors live on.
  virtual c10::Device device() const = 0;
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

  // Caller: the current stream waits for the job's device work (after the job is done on the host).
  virtual void blockCurrentStream() = 0;
  // Whether the job's device work has completed.
  virtual bool deviceDone() = 0;
};

class DeviceSupport {
 public:
  virtual ~DeviceSupport() = default;

  // The group's device side.
  static std::unique_ptr<DeviceSupport> create();

  // Calling thread: nullptr when every tensor is on the CPU; else the call's device side, ordered
  // after the current stream of the tensors' device. Raises naming `collective` when tensors sit
  // on different devices, or when this build has no CUDA path.
  virtual std::shared_ptr<DeviceCall> begin(const std::vector<at::Tensor>& outputs,
                                            const std::vector<at::Tensor>& inputs, const char* collective) = 0;
};

// The one device of a call's tensors: CPU when all are; raises naming `collective` when some
// differ. Used by every DeviceSupport.
c10::Device deviceOfCall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                         const char* collective);

} // namespace torus
