// The barrier of an arena round, bounded as a device phase: by the collective's deadline and by
// the path's stall bound, whichever comes first; a timeout names the phase.
#pragma once

#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

void device_barrier(Comm& comm, const DevicePath& path, const DevicePhase& phase);

} // namespace torus
