// torch_torus._C: the backend class and its configuration, for the Python shim.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "backend/process_group_torus.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, module) {
  module.doc() = "torch-torus: collective communication backend for torch.distributed";
  // c10d's Python types must exist before we derive from them.
  py::module::import("torch.distributed");

  py::class_<torus::AlgorithmRule>(module, "AlgorithmRule")
      .def(py::init([](const std::string& algorithm, uint64_t lo, uint64_t hi) {
             return torus::AlgorithmRule{lo, hi, algorithm};
           }),
           py::arg("algorithm"), py::arg("lo"), py::arg("hi"))
      .def_readonly("algorithm", &torus::AlgorithmRule::algorithm)
      .def_readonly("lo", &torus::AlgorithmRule::lo)
      .def_readonly("hi", &torus::AlgorithmRule::hi);

  py::class_<torus::TorusConfig>(module, "TorusConfig")
      .def(py::init<>())
      .def_readwrite("transport", &torus::TorusConfig::transport)
      .def_readwrite("address", &torus::TorusConfig::address)
      .def_readwrite("chunk_bytes", &torus::TorusConfig::chunkBytes)
      .def_readwrite("algorithms", &torus::TorusConfig::algorithms)
      .def_readwrite("torus_rows", &torus::TorusConfig::torusRows)
      .def_readwrite("torus_inner", &torus::TorusConfig::torusInner)
      .def_readwrite("log_level", &torus::TorusConfig::logLevel);

  py::class_<torus::ProcessGroupTorus, c10d::Backend, c10::intrusive_ptr<torus::ProcessGroupTorus>>(
      module, "ProcessGroupTorus")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds, torus::TorusConfig,
                    std::string>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("config"),
           py::arg("group_name"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("config", &torus::ProcessGroupTorus::config)
      .def(
          "algorithm_for",
          [](const torus::ProcessGroupTorus& group, const std::string& collective, uint64_t nbytes) {
            return std::string(torus::algorithmName(group.algorithmFor(collective, nbytes)));
          },
          py::arg("collective"), py::arg("nbytes"));
}
