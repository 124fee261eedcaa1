// torus_testing.OfiAdversary, for tests/test_wire_ofi.py: a libfabric endpoint of its own (the
// transport's ofi::Fabric, on the provider the group uses) that sends whatever bytes a test
// crafts, with whatever tag, to a rank's published endpoint: the OFI transport's wire, spoken by
// a peer that lies. Only in a build with libfabric (TORUS_WITH_OFI).
#pragma once

#include <pybind11/pybind11.h>

namespace torus {

void defineOfiAdversary(pybind11::module& module);

} // namespace torus
