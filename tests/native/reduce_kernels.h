// torus_testing's reduction kernel entry points, for tests/test_reduce_kernels.py: every
// instruction-set variant of every kernel, named, so that a machine with AVX-512 also tests the
// AVX2 and portable kernels that a machine without it dispatches to.
#pragma once

#include <pybind11/pybind11.h>

namespace torus {

void defineReduceKernels(pybind11::module& module);

} // namespace torus
