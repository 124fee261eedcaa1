// torch_torus._C._DeviceCollectivesOnHost, for tests/test_device_collectives.py: the collectives
// of collectives/device/ (arena reduce-scatter and allgather, the staged rings, the torus rows and
// columns) on a machine without a GPU. They are written against DevicePath and DeviceArenas
// alone, so a host implementation of both runs their logic unchanged: a HostDevicePath (copies by
// memcpy, reductions by the CPU reducer, staging in plain host memory; eager, or deferred until
// synchronize() as a stream may run them late) and HostArenas (one POSIX shared-memory segment per
// rank, mapped by the ranks that a `hosts` list puts on its host), over a TCP group.
#pragma once

#include <pybind11/pybind11.h>

namespace torus {

void defineDeviceCollectivesOnHost(pybind11::module& module);

} // namespace torus
