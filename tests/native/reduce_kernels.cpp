#include "reduce_kernels.h"

#include <torch/extension.h>

#include <string>

#include "reduce/reduce.h"

namespace torus {

namespace {

constexpr Isa kIsas[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512};

Isa isaNamed(const std::string& name) {
  for (Isa isa : kIsas) {
    if (name == isaName(isa)) {
      return isa;
    }
  }
  throw py::value_error("torus_testing: unknown instruction set '" + name + "'");
}

template <class Enum>
Enum named(const std::string& name, const char* (*nameOf)(Enum), int count, const char* what) {
  for (int i = 0; i < count; ++i) {
    if (name == nameOf(static_cast<Enum>(i))) {
      return static_cast<Enum>(i);
    }
  }
  throw py::value_error(std::string("torus_testing: unknown ") + what + " '" + name + "'");
}

DataType dataTypeOf(const torch::Tensor& tensor) {
  const std::string name = c10::toString(tensor.scalar_type());
  static const std::pair<const char*, const char*> kTorchNames[] = {
      {"Float", "float32"}, {"Double", "float64"}, {"Half", "float16"}, {"BFloat16", "bfloat16"},
      {"Char", "int8"},     {"Short", "int16"},    {"Int", "int32"},    {"Long", "int64"},
      {"Byte", "uint8"},    {"Bool", "bool"}};
  for (const auto& [torchName, ours] : kTorchNames) {
    if (name == torchName) {
      return named(ours, &dataTypeName, static_cast<int>(DataType::kBool) + 1, "dtype");
    }
  }
  throw py::value_error("torus_testing: no kernel for dtype " + name);
}

ReduceKind reduceKindOf(const std::string& op) {
  return named(op, &reduceKindName, static_cast<int>(ReduceKind::kBxor) + 1, "reduce op");
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
        const Reducer reducer = makeReducer(dataTypeOf(dst), reduceKindOf(op), isaNamed(isa));
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
        const DataType type = named(dtype, &dataTypeName, static_cast<int>(DataType::kBool) + 1, "dtype");
        const ReduceFn chosen = makeReducer(type, reduceKindOf(op)).fn;
        for (Isa isa : kIsas) {
          if (chosen != nullptr && makeReducer(type, reduceKindOf(op), isa).fn == chosen) {
            return py::str(isaName(isa));
          }
        }
        return py::none();
      },
      py::arg("dtype"), py::arg("op"),
      "The instruction set of the kernel that makeReducer(dtype, op) hands the collectives, or None.");
}

} // namespace torus
