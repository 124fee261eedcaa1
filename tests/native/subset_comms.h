// torus_testing.SubsetComms, for tests/test_shm.py: collectives on Comms over some ranks of a
// group, which the backend builds only as torus rows and columns — one_shot and two_shot on the
// ranks of one host inside a larger group, the single-copy reduce-scatter and allgather on their
// own, Comms of one host interleaved in any order.
#pragma once

#include <pybind11/pybind11.h>

namespace torus {

void defineSubsetComms(pybind11::module& module);

} // namespace torus
