// The CUDA build's DeviceSupport (see backend/device_support.h for the stream semantics): per
// group and device one communication stream from torch's pool, its CudaDevicePath and the IPC
// arenas of the ranks on this host; per call a ready event on the caller's stream and a done
// event on the communication stream.
#pragma once

#include <memory>

#include "backend/device_support.h"

namespace torus {

std::unique_ptr<DeviceSupport> makeCudaDeviceSupport(const DeviceOptions& options);

} // namespace torus
