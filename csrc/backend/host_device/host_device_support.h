// The host device layer (TORUS_HOST_DEVICE): the backend's device side with a "device" that is
// CPU memory, so that the whole control path of device calls runs on a machine without a GPU:
// ProcessGroupTorus -> DeviceSupport -> TorusWork's device branch -> the device collectives
// (collectives/device/) -> wait() / get_future() / then(). CPU tensors are its device tensors;
// other devices go to `other` (the CUDA layer, or the error of a build without it).
//
// Per group one HostDevicePath (eager) and the arenas of the ranks on this host in POSIX shared
// memory (SharedArenas over HostShmMemory, the exchange the CUDA layer uses). Per call a ready
// event, reached when the call is issued (the caller's writes to CPU tensors are done), and a
// done event, reached when the job records it; enter() waits for the first, and
// blockCurrentStream() (Work.wait's synchronize) for the second, on the host, each bounded by the
// stall bound. A fault (HostDeviceFault) makes a named phase stall, or enter() fail.
#pragma once

#include <memory>

#include "backend/device_support.h"

namespace torus {

std::unique_ptr<DeviceSupport> makeHostDeviceSupport(const DeviceOptions& options,
                                                     std::unique_ptr<DeviceSupport> other);

} // namespace torus
