#include "reduce_kernels.h"

#include <torch/extension.h>

#include <optional>
#include <string>

#include "backend/tensor_checks.h"
#include "reduce/reduce.h"

namespace torus {

namespace {

constexpr Isa kIsas[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512};

template <class Enum>
Enum known(std::optional<Enum> found, const std::string& name, const char* what) {
  if (!found) {
    throw py::value_error(std::string("torus_testing: unknown ") + what + " '" + name + "'");
  }
  return *found;
}

} // namespace

void defineReduceKernels(pybind11::module& module) {
  module.def("best_isa", [] { return std::string(isaName(bestIsa())); },
             "The widest instruction set this CPU and build run the kernels with.");
  module.def(
      "isas",
      [] {
        py::list names;
        for (Isa isa : kIsas) {
          names.append(isaName(isa));
        }
        return names;
      },
      "Every instruction set the kernels are built for, narrowest first.");
  module.def(
      "reduce_into",
      [](torch::Tensor dst, const torch::Tensor& src, const std::string& op, const std::string& isa) {
        TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "reduce_into: CPU tensors only");
        TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "reduce_into: contiguous tensors only");
        TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.numel() == src.numel(),
                    "reduce_into: dst and src differ in dtype or length");
        const Reducer reducer =
            makeReducer(toDataType(dst.scalar_type(), "reduce_into's dst"), known(reduceKindNamed(op), op, "reduce op"),
                        known(isaNamed(isa), isa, "instruction set"));
        if (reducer.fn == nullptr) {
          return false;
        }
        reducer(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(dst.numel()));
        return true;
      },
      py::arg("dst"), py::arg("src"), py::arg("op"), py::arg("isa"),
      "dst = dst (op) src with the kernel built for `isa`; False (dst untouched) where there is none: "
      "the pair is not supported, or `isa` is wider than best_isa().");
  module.def(
      "dispatched_isa",
      [](const std::string& dtype, const std::string& op) -> py::object {
        const DataType type = known(dataTypeNamed(dtype), dtype, "dtype");
        const ReduceKind kind = known(reduceKindNamed(op), op, "reduce op");
        const ReduceFn chosen = makeReducer(type, kind).fn;
        for (Isa isa : kIsas) {
          if (chosen != nullptr && makeReducer(type, kind, isa).fn == chosen) {
            return py::str(isaName(isa));
          }
        }
        return py::none();
      },
      py::arg("dtype"), py::arg("op"),
      "The instruction set of the kernel that makeReducer(dtype, op) hands the collectives, or None.");
}

} // namespace torus
