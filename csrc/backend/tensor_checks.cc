#include "backend/tensor_checks.h"

#include <ATen/MemoryOverlap.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace torus {

DataType toDataType(at::ScalarType type, const std::string& what) {
  switch (type) {
    case at::kFloat:
      return DataType::kFloat32;
    case at::kDouble:
      return DataType::kFloat64;
    case at::kHalf:
      return DataType::kFloat16;
    case at::kBFloat16:
      return DataType::kBFloat16;
    case at::kChar:
      return DataType::kInt8;
    case at::kShort:
      return DataType::kInt16;
    case at::kInt:
      return DataType::kInt32;
    case at::kLong:
      return DataType::kInt64;
    case at::kByte:
      return DataType::kUInt8;
    case at::kBool:
      return DataType::kBool;
    default:
      TORUS_CHECK(false, what, " has dtype ", type,
                  ", which is not supported (supported: float32, float64, float16, bfloat16, int8, int16, int32, "
                  "int64, uint8, bool)");
  }
}

void checkTensor(const at::Tensor& tensor, const std::string& what) {
  TORUS_CHECK(tensor.defined(), what, " is undefined");
  TORUS_CHECK(!tensor.is_cuda() || kBuiltWithCuda, what,
              " is a CUDA tensor, but this build of torch_torus has no CUDA path (built against a torch without "
              "CUDA, without a CUDA toolkit, or with TORUS_BUILD_CUDA=0); rebuild it next to a CUDA torch and "
              "toolkit, or map CUDA to another backend (backend=\"cpu:torus,cuda:gloo\")");
  TORUS_CHECK(tensor.device().is_cpu() || tensor.is_cuda(), what, " is on device ", tensor.device(),
              "; only CPU and CUDA tensors are supported");
  TORUS_CHECK(tensor.layout() == at::kStrided, what, " has layout ", tensor.layout(),
              "; only dense (strided) tensors are supported");
  toDataType(tensor.scalar_type(), what);
}

void checkOutput(const at::Tensor& tensor, const std::string& what) {
  checkTensor(tensor, what);
  TORUS_CHECK_ARG(at::has_internal_overlap(tensor) != at::MemOverlap::Yes, what,
                  " is an output, but several of its elements share memory (strides ", tensor.strides(),
                  ", e.g. from expand()); pass a tensor whose elements are distinct, such as a clone()");
}

void checkSameKind(const at::Tensor& tensor, const at::Tensor& reference, const std::string& what,
                   const std::string& referenceName, bool output) {
  if (output) {
    checkOutput(tensor, what);
  } else {
    checkTensor(tensor, what);
  }
  TORUS_CHECK_ARG(tensor.scalar_type() == reference.scalar_type(), what, " has dtype ", tensor.scalar_type(), " but ",
                  referenceName, " has dtype ", reference.scalar_type());
  TORUS_CHECK_ARG(tensor.numel() == reference.numel(), what, " has ", tensor.numel(), " elements but ", referenceName,
                  " has ", reference.numel());
}

void checkRoot(int64_t root, int size, const char* collective, const char* argument) {
  TORUS_CHECK_ARG(root >= 0 && root < size, collective, " ", argument, "=", root,
                  " (the root rank) is out of range: the group has ", size, " ranks, 0 to ", size - 1);
}

void checkPeer(int peer, int rank, int size, const char* what) {
  TORUS_CHECK_ARG(peer >= 0 && peer < size, what, "=", peer, " is out of range: the group has ", size, " ranks, 0 to ",
                  size - 1);
  TORUS_CHECK_ARG(peer != rank, what, "=", peer, " is this rank itself");
}

void checkSingle(size_t count, const char* what) {
  TORUS_CHECK_ARG(count == 1, what, " takes exactly one tensor, got ", count);
}

void checkListLength(size_t length, int size, const std::string& what) {
  TORUS_CHECK_ARG(length == static_cast<size_t>(size), what, " has ", length, " tensors but the group has ", size,
                  " ranks; it needs one per rank");
}

void checkTimeout(std::chrono::milliseconds timeout, const char* collective) {
  TORUS_CHECK_ARG(timeout == c10d::kUnsetTimeout || timeout.count() > 0, collective,
                  " timeout must be positive (or unset, for the group's timeout), got ", timeout.count(), " ms");
}

std::vector<at::Tensor> checkRootList(const std::vector<std::vector<at::Tensor>>& lists, const RootList& list,
                                      int rank, int root, int size, const at::Tensor& reference) {
  const std::string what = std::string(list.collective) + " " + list.name;
  if (rank != root) {
    TORUS_CHECK_ARG(lists.empty() || (lists.size() == 1 && lists[0].empty()), what,
                    " must be empty on ranks other than ", list.rootName, " (rank ", rank, " is not ", list.rootName,
                    "=", root, ")");
    return {};
  }
  checkSingle(lists.size(), (std::string(list.collective) + " " + list.role).c_str());
  const std::vector<at::Tensor>& tensors = lists[0];
  checkListLength(tensors.size(), size, what);
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkSameKind(tensors[i], reference, indexed(what, i), list.referenceName, list.output);
  }
  return tensors;
}

std::string indexed(const std::string& name, size_t i) {
  return name + "[" + std::to_string(i) + "]";
}

} // namespace torus
