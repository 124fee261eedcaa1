// torus_testing.DeviceCollectivesOnHost, for tests/test_device_collectives.py: the collectives
// of collectives/device/ (arena reduce-scatter and allgather, the staged rings, the torus rows and
// columns) called one by one, on any ranks, blocks and offsets, over a TCP group, through the
// backend's host device layer (backend/host_device/: HostDevicePath, eager or deferred, with its
// range checks on; arenas in POSIX shared memory exchanged by SharedArenas among the ranks that a
// `hosts` list puts on one host). The backend runs the same layer under TORUS_HOST_DEVICE; this
// binding only reaches the algorithms below the backend's entry points.
#pragma once

#include <pybind11/pybind11.h>

namespace torus {

void defineDeviceCollectivesOnHost(pybind11::module& module);

} // namespace torus
