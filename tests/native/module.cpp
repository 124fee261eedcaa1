// torus_testing: the test-only entry points, a module of their own that tests/torus_testing.py
// builds when a test first needs it, linked against the torch_torus._C under test. The package
// never holds them.
#include <torch/extension.h>

#include "device_collectives_on_host.h"
#include "subset_comms.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  torus::defineSubsetComms(module);
  torus::defineDeviceCollectivesOnHost(module);
}
