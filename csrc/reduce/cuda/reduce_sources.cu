// The CUDA reduction kernel: dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... for every dtype and op
// of the CPU reducer.
//
// One template, reduceSourcesKernel<T, Op>, instantiated per (storage type, op): each thread
// loads a 16-byte pack from every source, combines them in Arith<T>::Acc (float for float16 and
// bfloat16) and stores one pack, in a grid-stride loop; the elements outside the packs take the
// same path one at a time. Integer SUM, PRODUCT and bitwise ops run on the unsigned twin of the
// type, where wrap-around is defined, MIN and MAX on the signed type; bool runs on its byte with
// the op boolReduceKind gives. Two buffers (dst op= src) are the case of two sources, dst first.
//
// Sources travel in the kernel's parameters (kMaxSourcesPerLaunch pointers, 256 bytes), so a
// launch needs no device-side pointer table and no copy before it.

#include "reduce/cuda/reduce_cuda.h"

#include "reduce/cuda/elementwise.cuh"

namespace torus {
namespace cuda {

namespace {

using detail::Arith;
using detail::kLanes;
using detail::Pack;
using detail::Span;

struct SourceList {
  const void* pointers[kMaxSourcesPerLaunch];
};

// Integers narrower than unsigned int are promoted to signed int by C++, where a product of two
// 16-bit values can overflow (UB); computing in unsigned int wraps as the narrow type does.
template <class A>
using Promoted = std::conditional_t<std::is_integral<A>::value && (sizeof(A) < sizeof(unsigned)), unsigned, A>;

struct Sum {
  template <class A>
  __device__ static A apply(A a, A b) {
    return static_cast<A>(static_cast<Promoted<A>>(a) + static_cast<Promoted<A>>(b));
  }
};

struct Product {
  template <class A>
  __device__ static A apply(A a, A b) {
    return static_cast<A>(static_cast<Promoted<A>>(a) * static_cast<Promoted<A>>(b));
  }
};

// Like torch.minimum/maximum, NaN in either input gives NaN (a != a is false for integers).
struct Min {
  template <class A>
  __device__ static A apply(A a, A b) {
    if (a != a) {
      return a;
    }
    if (b != b) {
      return b;
    }
    return b < a ? b : a;
  }
};

struct Max {
  template <class A>
  __device__ static A apply(A a, A b) {
    if (a != a) {
      return a;
    }
    if (b != b) {
      return b;
    }
    return b > a ? b : a;
  }
};

struct BitAnd {
  template <class A>
  __device__ static A apply(A a, A b) {
    return a & b;
  }
};

struct BitOr {
  template <class A>
  __device__ static A apply(A a, A b) {
    return a | b;
  }
};

struct BitXor {
  template <class A>
  __device__ static A apply(A a, A b) {
    return a ^ b;
  }
};

template <class T, class Op>
__global__ void __launch_bounds__(detail::kThreadsPerBlock)
    reduceSourcesKernel(T* dst, SourceList sources, int numSources, Span span) {
  using A = typename Arith<T>::Acc;
  constexpr size_t lanes = kLanes<T>;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const T* source0 = static_cast<const T*>(sources.pointers[0]);

  for (size_t p = first; p < span.packs; p += stride) {
    const size_t i = span.head + p * lanes;
    const Pack<T> in = *reinterpret_cast<const Pack<T>*>(source0 + i);
    A acc[lanes];
#pragma unroll
    for (size_t l = 0; l < lanes; ++l) {
      acc[l] = Arith<T>::widen(in.lanes[l]);
    }
    for (int j = 1; j < numSources; ++j) {
      const Pack<T> next = *reinterpret_cast<const Pack<T>*>(static_cast<const T*>(sources.pointers[j]) + i);
#pragma unroll
      for (size_t l = 0; l < lanes; ++l) {
        acc[l] = Op::apply(acc[l], Arith<T>::widen(next.lanes[l]));
      }
    }
    Pack<T> out;
#pragma unroll
    for (size_t l = 0; l < lanes; ++l) {
      out.lanes[l] = Arith<T>::narrow(acc[l]);
    }
    *reinterpret_cast<Pack<T>*>(dst + i) = out;
  }

  const size_t packed = span.packs * lanes;
  const size_t singles = span.count - packed;
  for (size_t r = first; r < singles; r += stride) {
    const size_t i = r < span.head ? r : r + packed;
    A acc = Arith<T>::widen(source0[i]);
    for (int j = 1; j < numSources; ++j) {
      acc = Op::apply(acc, Arith<T>::widen(static_cast<const T*>(sources.pointers[j])[i]));
    }
    dst[i] = Arith<T>::narrow(acc);
  }
}

// One launch over at most kMaxSourcesPerLaunch sources.
template <class T, class Op>
void launch(void* dst, const void* const* srcs, int numSources, size_t count, cudaStream_t stream) {
  SourceList sources{};
  for (int j = 0; j < numSources; ++j) {
    sources.pointers[j] = srcs[j];
  }
  const Span span = detail::spanOf<T>(dst, srcs, numSources, count);
  const unsigned blocks = detail::blocksFor(span.packs + (span.count - span.packs * kLanes<T>));
  reduceSourcesKernel<T, Op><<<blocks, detail::kThreadsPerBlock, 0, stream>>>(static_cast<T*>(dst), sources,
                                                                              numSources, span);
}

using LaunchFn = void (*)(void*, const void* const*, int, size_t, cudaStream_t);

template <class T>
LaunchFn floatLaunch(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum:
      return &launch<T, Sum>;
    case ReduceKind::kProduct:
      return &launch<T, Product>;
    case ReduceKind::kMin:
      return &launch<T, Min>;
    case ReduceKind::kMax:
      return &launch<T, Max>;
    default:
      return nullptr;
  }
}

template <class T>
LaunchFn intLaunch(ReduceKind kind) {
  using U = std::make_unsigned_t<T>;
  switch (kind) {
    case ReduceKind::kSum:
      return &launch<U, Sum>;
    case ReduceKind::kProduct:
      return &launch<U, Product>;
    case ReduceKind::kMin:
      return &launch<T, Min>;
    case ReduceKind::kMax:
      return &launch<T, Max>;
    case ReduceKind::kBand:
      return &launch<U, BitAnd>;
    case ReduceKind::kBor:
      return &launch<U, BitOr>;
    case ReduceKind::kBxor:
      return &launch<U, BitXor>;
  }
  return nullptr;
}

// The launcher for (dtype, kind), nullptr where the CPU reducer has no kernel either.
LaunchFn launchFor(DataType dtype, ReduceKind kind) {
  switch (dtype) {
    case DataType::kFloat32:
      return floatLaunch<float>(kind);
    case DataType::kFloat64:
      return floatLaunch<double>(kind);
    case DataType::kFloat16:
      return floatLaunch<__half>(kind);
    case DataType::kBFloat16:
      return floatLaunch<__nv_bfloat16>(kind);
    case DataType::kInt8:
      return intLaunch<int8_t>(kind);
    case DataType::kInt16:
      return intLaunch<int16_t>(kind);
    case DataType::kInt32:
      return intLaunch<int32_t>(kind);
    case DataType::kInt64:
      return intLaunch<int64_t>(kind);
    case DataType::kUInt8:
      return intLaunch<uint8_t>(kind);
    case DataType::kBool:
      return intLaunch<uint8_t>(boolReduceKind(kind));
  }
  return nullptr;
}

} // namespace

void reduceSourcesOnDevice(DataType dtype, ReduceKind kind, void* dst, const void* const* srcs, int numSources,
                           size_t count, cudaStream_t stream) {
  const std::string what = std::string("reduction ") + reduceKindName(kind) + " of " + dataTypeName(dtype);
  const LaunchFn launcher = launchFor(dtype, kind);
  if (launcher == nullptr) {
    throw std::invalid_argument("torus: CUDA " + what + " is not supported (bitwise ops need integer or bool)");
  }
  if (numSources < 1) {
    throw std::invalid_argument("torus: CUDA " + what + " needs at least one source, got " +
                                std::to_string(numSources));
  }
  if (count == 0) {
    return;
  }
  if (dst == nullptr) {
    throw std::invalid_argument("torus: CUDA " + what + ": the destination is null");
  }
  for (int j = 0; j < numSources; ++j) {
    if (srcs[j] == nullptr) {
      throw std::invalid_argument("torus: CUDA " + what + ": source " + std::to_string(j) + " is null");
    }
    // Later launches read dst as their first source: a source after the first launch's that is
    // dst itself would already have been overwritten.
    if (j >= kMaxSourcesPerLaunch && srcs[j] == dst) {
      throw std::invalid_argument("torus: CUDA " + what + ": source " + std::to_string(j) +
                                  " is the destination; only the first " + std::to_string(kMaxSourcesPerLaunch) +
                                  " sources may be");
    }
  }

  int done = numSources < kMaxSourcesPerLaunch ? numSources : kMaxSourcesPerLaunch;
  launcher(dst, srcs, done, count, stream);
  detail::throwIfLaunchFailed(what);
  while (done < numSources) {
    const void* batch[kMaxSourcesPerLaunch];
    batch[0] = dst;
    int taken = 1;
    for (; taken < kMaxSourcesPerLaunch && done < numSources; ++taken, ++done) {
      batch[taken] = srcs[done];
    }
    launcher(dst, batch, taken, count, stream);
    detail::throwIfLaunchFailed(what);
  }
}

} // namespace cuda
} // namespace torus
