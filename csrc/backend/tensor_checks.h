// Argument checks shared by the entry points: each failure names the argument as
// torch.distributed names it ("all_gather tensor_list[3]") and happens on the calling thread,
// before any byte moves.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "reduce/reduce.h"

// TORCH_CHECK_VALUE / TORCH_CHECK with the backend's "torus: " prefix.
#define TORUS_CHECK_ARG(cond, ...) TORCH_CHECK_VALUE(cond, "torus: ", __VA_ARGS__)
#define TORUS_CHECK(cond, ...) TORCH_CHECK(cond, "torus: ", __VA_ARGS__)

namespace torus {

// Whether this build has the CUDA path (torch with CUDA and a toolkit at build time).
#ifdef TORUS_WITH_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

// The reducer's dtype for a tensor's; raises naming `what` when the dtype is not supported.
DataType toDataType(at::ScalarType type, const std::string& what);

// What every collective needs of a tensor.
void checkTensor(const at::Tensor& tensor, const std::string& what);
// A tensor the collective writes into: checkTensor, and no two of its elements may share memory
// (an expand()ed tensor): writing the result there fails or is undefined, and it would fail only
// after the bytes had moved.
void checkOutput(const at::Tensor& tensor, const std::string& what);
// checkTensor or checkOutput, and the dtype and element count of `reference`.
void checkSameKind(const at::Tensor& tensor, const at::Tensor& reference, const std::string& what,
                   const std::string& referenceName, bool output);
// `argument` is torch.distributed's name for the root: "src" (broadcast, scatter) or "dst".
void checkRoot(int64_t root, int size, const char* collective, const char* argument);
// `what` is e.g. "send dst": a rank of the group other than this one.
void checkPeer(int peer, int rank, int size, const char* what);
void checkSingle(size_t count, const char* what);
void checkListLength(size_t length, int size, const std::string& what);
// A per-call timeout (BarrierOptions.timeout and the like): unset, or positive. Zero or a negative
// one would expire before the first byte arrives and leave the group failed.
void checkTimeout(std::chrono::milliseconds timeout, const char* collective);

// The tensor list that only the root passes (gather's gather_list, scatter's scatter_list): on the
// root one list of one tensor per rank, each of `reference`'s dtype and size; elsewhere none.
// Returns the root's list, empty elsewhere.
struct RootList {
  const char* collective; // "gather"
  const char* name;       // "gather_list"
  const char* role;       // "output list": what the list is to the collective
  const char* rootName;   // "dst": torch.distributed's name for the root
  const char* referenceName; // "the input tensor"
  bool output;            // the collective writes into the list
};
std::vector<at::Tensor> checkRootList(const std::vector<std::vector<at::Tensor>>& lists, const RootList& list,
                                      int rank, int root, int size, const at::Tensor& reference);

// "name[i]"
std::string indexed(const std::string& name, size_t i);

} // namespace torus
