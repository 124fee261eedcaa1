// The CUDA scaling kernel: buf[i] = buf[i] * factor or buf[i] / factor, for the element-wise
// work torch's reduce ops add around a sum (PREMUL_SUM before it, AVG after it).
//
// It computes as torch's CPU mul_ and div_ with a scalar do, so a CUDA reduction matches the CPU
// path: in double for float64, in float for the others (the factor rounded to float once), a
// true division for AVG rather than a product with the reciprocal. Same 16-byte packs and
// grid-stride loops as the reduction kernel.

#include "reduce/cuda/reduce_cuda.h"

#include "reduce/cuda/elementwise.cuh"

namespace torus {
namespace cuda {

namespace {

using detail::Arith;
using detail::kLanes;
using detail::Pack;
using detail::Span;

template <ScaleKind kKind, class A>
__device__ A scaled(A value, A factor) {
  if constexpr (kKind == ScaleKind::kMultiply) {
    return value * factor;
  } else {
    return value / factor;
  }
}

template <class T, ScaleKind kKind>
__global__ void __launch_bounds__(detail::kThreadsPerBlock)
    scaleKernel(T* buf, typename Arith<T>::Acc factor, Span span) {
  constexpr size_t lanes = kLanes<T>;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  for (size_t p = first; p < span.packs; p += stride) {
    Pack<T>* at = reinterpret_cast<Pack<T>*>(buf + span.head + p * lanes);
    Pack<T> pack = *at;
#pragma unroll
    for (size_t l = 0; l < lanes; ++l) {
      pack.lanes[l] = Arith<T>::narrow(scaled<kKind>(Arith<T>::widen(pack.lanes[l]), factor));
    }
    *at = pack;
  }

  const size_t packed = span.packs * lanes;
  const size_t singles = span.count - packed;
  for (size_t r = first; r < singles; r += stride) {
    const size_t i = r < span.head ? r : r + packed;
    buf[i] = Arith<T>::narrow(scaled<kKind>(Arith<T>::widen(buf[i]), factor));
  }
}

template <class T>
void launch(ScaleKind kind, void* buf, size_t count, double factor, cudaStream_t stream) {
  using A = typename Arith<T>::Acc;
  const void* self[1] = {buf};
  const Span span = detail::spanOf<T>(buf, self, 1, count);
  const unsigned blocks = detail::blocksFor(span.packs + (span.count - span.packs * kLanes<T>));
  T* typed = static_cast<T*>(buf);
  if (kind == ScaleKind::kMultiply) {
    scaleKernel<T, ScaleKind::kMultiply><<<blocks, detail::kThreadsPerBlock, 0, stream>>>(typed, A(factor), span);
  } else {
    scaleKernel<T, ScaleKind::kDivide><<<blocks, detail::kThreadsPerBlock, 0, stream>>>(typed, A(factor), span);
  }
}

} // namespace

void scaleOnDevice(DataType dtype, ScaleKind kind, void* buf, size_t count, double factor, cudaStream_t stream) {
  const std::string what =
      std::string(kind == ScaleKind::kMultiply ? "multiplication" : "division") + " of " + dataTypeName(dtype);
  if (!isFloatingPoint(dtype)) {
    throw std::invalid_argument("torus: CUDA " + what +
                                " is not supported (scaling is for AVG and PREMUL_SUM, on floating-point dtypes)");
  }
  if (count == 0) {
    return;
  }
  if (buf == nullptr) {
    throw std::invalid_argument("torus: CUDA " + what + ": the buffer is null");
  }
  switch (dtype) {
    case DataType::kFloat32:
      launch<float>(kind, buf, count, factor, stream);
      break;
    case DataType::kFloat64:
      launch<double>(kind, buf, count, factor, stream);
      break;
    case DataType::kFloat16:
      launch<__half>(kind, buf, count, factor, stream);
      break;
    case DataType::kBFloat16:
      launch<__nv_bfloat16>(kind, buf, count, factor, stream);
      break;
    default:
      break;
  }
  detail::throwIfLaunchFailed(what);
}

} // namespace cuda
} // namespace torus
