// Element-wise reductions of device buffers, run as CUDA kernels on a caller's stream.
//
// The GPU twin of reduce/reduce.h, for the CUDA paths of the backend: the staged path reduces a
// chunk received from another host into the device buffer, the same-host path reduces peers'
// device buffers (opened from CUDA IPC handles) straight into the output. Same dtypes and ops,
// same semantics as the CPU reducer: integer SUM and PRODUCT wrap around, bitwise ops only on
// integers and bool, bool's SUM and MAX are OR, PRODUCT and MIN are AND, MIN and MAX return NaN
// when either input is NaN, float16 and bfloat16 are computed in float and rounded to nearest-even.
//
// Knows nothing of torch, so nvcc compiles the kernels standalone. Every call only enqueues work
// on `stream` (no synchronization); a launch failure throws std::runtime_error, bad arguments
// std::invalid_argument, each naming the dtype and op.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "reduce/reduce.h"

namespace torus {
namespace cuda {

// The most sources one kernel launch reads; reduceSourcesOnDevice folds more in several passes.
constexpr int kMaxSourcesPerLaunch = 32;

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[numSources - 1][i] for i in [0, count),
// all pointers on the current device (or mapped into it: IPC and pinned host memory). float16
// and bfloat16 are accumulated in float and rounded once per launch. More sources than
// kMaxSourcesPerLaunch take several launches, each folding the next sources into dst, so dst may
// be any one of the first kMaxSourcesPerLaunch sources but none after them. Loads and stores
// are 16 bytes wide when all pointers share dst's alignment modulo 16, element-wise otherwise.
void reduceSourcesOnDevice(DataType dtype, ReduceKind kind, void* dst, const void* const* srcs, int numSources,
                           size_t count, cudaStream_t stream);

// dst[i] = dst[i] (op) src[i]: the two-buffer form the pipelined collectives use.
inline void reduceOnDevice(DataType dtype, ReduceKind kind, void* dst, const void* src, size_t count,
                           cudaStream_t stream) {
  const void* srcs[2] = {dst, src};
  reduceSourcesOnDevice(dtype, kind, dst, srcs, 2, count, stream);
}

// What torch's ops add around a sum: PREMUL_SUM multiplies each rank's input by a factor before
// the reduction, AVG divides the result by the group's size after it.
enum class ScaleKind : uint8_t {
  kMultiply,
  kDivide,
};

// buf[i] = buf[i] * factor or buf[i] / factor, computed as torch's CPU mul_ and div_ with a
// scalar are: in double for float64, in float for float32, float16 and bfloat16. Floating-point
// dtypes only.
void scaleOnDevice(DataType dtype, ScaleKind kind, void* buf, size_t count, double factor, cudaStream_t stream);

} // namespace cuda
} // namespace torus
