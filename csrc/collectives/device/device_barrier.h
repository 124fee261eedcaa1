// Message exchanges inside a device collective (an arena round's barrier, the arena exchange),
// bounded as device phases: by the collective's deadline and by the path's stall bound,
// whichever comes first; a timeout of the stall bound names the phase.
#pragma once

#include <functional>
#include <string>

#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

// Runs `exchange` (messages on comm) under the phase's bound; comm's deadline is restored after.
void boundedPhase(Comm& comm, const DevicePath& path, const std::string& phase, const std::function<void()>& exchange);

void device_barrier(Comm& comm, const DevicePath& path, const DevicePhase& phase);

} // namespace torus
