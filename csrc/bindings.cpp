// torch_torus._C: the backend class and its configuration, for the Python shim.
#include <pybind11/chrono.h>
#include <torch/python.h>

#include "backend/process_group_torus.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, module) {
  module.doc() = "torch-torus: collective communication backend for torch.distributed";
  // c10d's Python types must exist before we derive from them.
  py::module::import("torch.distributed");

  py::class_<torus::TorusConfig>(module, "TorusConfig")
      .def(py::init<>())
      .def_readwrite("address", &torus::TorusConfig::address)
      .def_readwrite("chunk_bytes", &torus::TorusConfig::chunkBytes)
      .def_readwrite("allreduce", &torus::TorusConfig::allreduce)
      .def_readwrite("log_level", &torus::TorusConfig::logLevel);

  py::class_<torus::ProcessGroupTorus, c10d::Backend, c10::intrusive_ptr<torus::ProcessGroupTorus>>(
      module, "ProcessGroupTorus")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds, torus::TorusConfig,
                    std::string>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("config"),
           py::arg("group_name"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("config", &torus::ProcessGroupTorus::config);
}
