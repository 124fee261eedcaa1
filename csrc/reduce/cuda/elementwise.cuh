// What the element-wise CUDA kernels share: the arithmetic type of each storage type, 16-byte
// packs, the split of a buffer into an element-wise head, a vectorized body and an element-wise
// tail, launch geometry and launch-error reporting.
//
// A buffer is walked as one grid-stride loop over 16-byte packs (one 128-bit load per source and
// one 128-bit store per pack, what saturates HBM on sm_80/sm_90) and one over the elements left
// outside the packs. The packs start where dst reaches a 16-byte boundary; when some source sits
// at another offset modulo 16 no pack can be aligned for all, and every element goes the
// element-wise way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "reduce/reduce.h"

namespace torus {
namespace cuda {
namespace detail {

constexpr size_t kPackBytes = 16;
constexpr unsigned kThreadsPerBlock = 256;
// Enough blocks to fill the largest GPUs several times over (132 SMs x 2048 threads on H100 is
// 1056 blocks of 256); larger buffers loop inside the grid instead of launching more blocks.
constexpr unsigned kMaxBlocks = 4096;

// The type a storage type is computed in: itself, except float16 and bfloat16, widened to float
// and rounded back to nearest-even, as the CPU reducer does.
template <class T>
struct Arith {
  using Acc = T;
  __device__ static Acc widen(T v) {
    return v;
  }
  __device__ static T narrow(Acc a) {
    return a;
  }
};

template <>
struct Arith<__half> {
  using Acc = float;
  __device__ static Acc widen(__half v) {
    return __half2float(v);
  }
  __device__ static __half narrow(Acc a) {
    return __float2half_rn(a);
  }
};

template <>
struct Arith<__nv_bfloat16> {
  using Acc = float;
  __device__ static Acc widen(__nv_bfloat16 v) {
    return __bfloat162float(v);
  }
  __device__ static __nv_bfloat16 narrow(Acc a) {
    return __float2bfloat16_rn(a);
  }
};

template <class T>
constexpr size_t kLanes = kPackBytes / sizeof(T);

// 16 bytes of T, loaded and stored as one 128-bit access.
template <class T>
struct alignas(kPackBytes) Pack {
  T lanes[kLanes<T>];
};

// Elements [0, head) and [head + packs * kLanes<T>, count) go element-wise, the rest in packs.
struct Span {
  size_t head = 0;
  size_t packs = 0;
  size_t count = 0;
};

template <class T>
Span spanOf(const void* dst, const void* const* srcs, int numSources, size_t count) {
  Span span;
  span.count = count;
  const uintptr_t offset = reinterpret_cast<uintptr_t>(dst) % kPackBytes;
  for (int j = 0; j < numSources; ++j) {
    if (reinterpret_cast<uintptr_t>(srcs[j]) % kPackBytes != offset) {
      return span;
    }
  }
  if (offset % sizeof(T) != 0) {
    return span;
  }
  const size_t head = (kPackBytes - offset) % kPackBytes / sizeof(T);
  span.head = head < count ? head : count;
  span.packs = (count - span.head) / kLanes<T>;
  return span;
}

// Blocks for a grid-stride loop over `units` packs or elements; at least one.
inline unsigned blocksFor(size_t units) {
  const size_t blocks = (units + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (blocks == 0) {
    return 1;
  }
  return blocks < kMaxBlocks ? static_cast<unsigned>(blocks) : kMaxBlocks;
}

// `what` names the call, e.g. "reduction sum of float16".
inline void throwIfLaunchFailed(const std::string& what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    throw std::runtime_error("torus: CUDA " + what + " failed to launch: " + cudaGetErrorName(error) + ": " +
                             cudaGetErrorString(error));
  }
}

} // namespace detail
} // namespace cuda
} // namespace torus
