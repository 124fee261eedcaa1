// Reduction kernels and their run-time dispatch.
//
// Every kernel is one template, run<W, Codec, Op>, written with GCC/Clang generic vectors of W
// bytes, and built three times: W = 16 with no target attribute (portable: SSE2 on x86-64, NEON
// on AArch64, plain scalar code elsewhere), W = 32 under target("avx2,f16c") and W = 64 under
// target("avx512f,avx512bw"). The entry points are flattened, so the loop, the op and the codec
// are all compiled for the entry's target. makeReducer looks the CPU up once
// (__builtin_cpu_supports) and hands back a plain function pointer: a call costs one indirect
// jump and no feature test.
//
// A Codec says how lanes are stored and computed: Plain<T> computes in T, Half and BFloat16
// widen to float and round back to nearest-even. Integer SUM, PRODUCT and bitwise ops run on the
// unsigned twin of the type, where wrap-around is defined (signed overflow is UB in C++).

#include "reduce/reduce.h"

#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace torus {

namespace {

template <class T, size_t W>
struct VecOf {
  typedef T type __attribute__((vector_size(W)));
};

// W bytes of T lanes.
template <class T, size_t W>
using Vec = typename VecOf<T, W>::type;

// Ops and codecs take vectors by reference: passing a 32- or 64-byte vector by value to a
// function built without AVX changes the ABI (GCC's -Wpsabi), and all of it is inlined anyway.

struct Sum {
  template <class V>
  static void apply(V& a, const V& b) {
    a = a + b;
  }
};

struct Product {
  template <class V>
  static void apply(V& a, const V& b) {
    a = a * b;
  }
};

// Like torch.minimum/maximum, NaN in either input gives NaN: any comparison with NaN is false,
// so b is taken unless a is NaN. (a != a is false for integers and folds away.)
struct Min {
  template <class V>
  static void apply(V& a, const V& b) {
    a = ((a < b) | (a != a)) ? a : b;
  }
};

struct Max {
  template <class V>
  static void apply(V& a, const V& b) {
    a = ((a > b) | (a != a)) ? a : b;
  }
};

struct BitAnd {
  template <class V>
  static void apply(V& a, const V& b) {
    a = a & b;
  }
};

struct BitOr {
  template <class V>
  static void apply(V& a, const V& b) {
    a = a | b;
  }
};

struct BitXor {
  template <class V>
  static void apply(V& a, const V& b) {
    a = a ^ b;
  }
};

template <class T>
struct Plain {
  using Storage = T;
  using Lane = T;

  template <class V>
  static void load(V& v, const T* p) {
    memcpy(&v, p, sizeof v);
  }
  template <class V>
  static void store(T* p, const V& v) {
    memcpy(p, &v, sizeof v);
  }
};

// The float lanes V widen to, as unsigned integers, and the 16-bit lanes they come from.
template <class V>
using U32Of = Vec<uint32_t, sizeof(V)>;
template <class V>
using U16Of = Vec<uint16_t, sizeof(V) / 2>;

struct BFloat16 {
  using Storage = uint16_t;
  using Lane = float;

  template <class V>
  static void load(V& v, const uint16_t* p) {
    U16Of<V> h;
    memcpy(&h, p, sizeof h);
    v = __builtin_bit_cast(V, __builtin_convertvector(h, U32Of<V>) << 16);
  }

  // Round to nearest, ties to even; NaN becomes the quiet NaN that c10::BFloat16 writes.
  template <class V>
  static void store(uint16_t* p, const V& v) {
    U32Of<V> w = __builtin_bit_cast(U32Of<V>, v);
    U32Of<V> rounded = (w + 0x7FFF + ((w >> 16) & 1)) >> 16;
    U16Of<V> h = __builtin_convertvector((v != v) ? U32Of<V>{} + 0x7FC0 : rounded, U16Of<V>);
    memcpy(p, &h, sizeof h);
  }
};

// IEEE half. The templates are the portable path: the branch-free conversions of the FP16
// library (also c10::Half's software fallback), done on all lanes at once. x86 builds add
// overloads for the AVX2 and AVX-512 widths that use the hardware conversions instead.
struct Half {
  using Storage = uint16_t;
  using Lane = float;

  template <class V>
  static void load(V& v, const uint16_t* p) {
    using U = U32Of<V>;
    U16Of<V> h;
    memcpy(&h, p, sizeof h);
    U w = __builtin_convertvector(h, U) << 16;
    U twice = w + w; // the sign shifted out
    // Normal, Inf and NaN: move exponent and mantissa into place and rebias by 2^-112.
    V normal = __builtin_bit_cast(V, (twice >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    // Subnormal: build 0.5 + m * 2^-24 exactly and subtract 0.5.
    V subnormal = __builtin_bit_cast(V, (twice >> 17) | (126u << 23)) - 0.5f;
    U bits = (twice < (1u << 27)) ? __builtin_bit_cast(U, subnormal) : __builtin_bit_cast(U, normal);
    v = __builtin_bit_cast(V, (w & 0x80000000u) | bits);
  }

  template <class V>
  static void store(uint16_t* p, const V& v) {
    using U = U32Of<V>;
    U w = __builtin_bit_cast(U, v);
    U twice = w + w; // the sign shifted out
    // Scaling by 2^112 then 2^-110 sends overflow to Inf; adding a power of two aligned to the
    // half's ulp then lets the FPU round to nearest-even, subnormals included.
    V base = __builtin_bit_cast(V, w & 0x7FFFFFFFu) * 0x1.0p+112f * 0x1.0p-110f;
    U bias = twice & 0xFF000000u;
    bias = (bias < 0x71000000u) ? U{} + 0x71000000u : bias;
    U bits = __builtin_bit_cast(U, __builtin_bit_cast(V, (bias >> 1) + 0x07800000u) + base);
    U magnitude = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    U half = ((w >> 16) & 0x8000u) | ((twice > 0xFF000000u) ? U{} + 0x7E00u : magnitude);
    U16Of<V> h = __builtin_convertvector(half, U16Of<V>);
    memcpy(p, &h, sizeof h);
  }

#if defined(__x86_64__)
  __attribute__((target("avx2,f16c"))) static void load(Vec<float, 32>& v, const uint16_t* p) {
    v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  __attribute__((target("avx2,f16c"))) static void store(uint16_t* p, const Vec<float, 32>& v) {
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  // The all-lanes masked forms: GCC 12's unmasked ones trip -Wmaybe-uninitialized.
  __attribute__((target("avx512f"))) static void load(Vec<float, 64>& v, const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    v = _mm512_maskz_cvtph_ps(0xFFFF, h);
  }
  __attribute__((target("avx512f"))) static void store(uint16_t* p, const Vec<float, 64>& v) {
    __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, v, _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
#endif
};

// dst[i] = dst[i] op src[i] with W-byte vectors of the codec's lanes.
template <size_t W, class C, class Op>
void run(void* dst, const void* src, size_t count) {
  using S = typename C::Storage;
  using V = Vec<typename C::Lane, W>;
  constexpr size_t kLanes = W / sizeof(typename C::Lane);
  constexpr size_t kBlockBytes = kLanes * sizeof(S);
  constexpr size_t kUnroll = 4;

  S* d = static_cast<S*>(dst);
  const S* s = static_cast<const S*>(src);
  auto block = [](S* dd, const S* ss) {
    V a;
    V b;
    C::load(a, dd);
    C::load(b, ss);
    Op::apply(a, b);
    C::store(dd, a);
  };
  // Fewer than kLanes elements go through the same vector code on zero-padded copies, so every
  // element gets bit-identical treatment wherever it sits; zero is harmless to every op.
  auto partial = [&block](S* dd, const S* ss, size_t n) {
    S bd[kLanes] = {};
    S bs[kLanes] = {};
    memcpy(bd, dd, n * sizeof(S));
    memcpy(bs, ss, n * sizeof(S));
    block(bd, bs);
    memcpy(dd, bd, n * sizeof(S));
  };

  // Align dst to a block so that its loads and stores never straddle cache lines (src may
  // still be misaligned relative to it: loads split more cheaply than stores).
  size_t head = (-reinterpret_cast<uintptr_t>(d) % kBlockBytes) / sizeof(S);
  head = head < count ? head : count;
  if (head > 0) {
    partial(d, s, head);
  }
  size_t i = head;
  for (; i + kUnroll * kLanes <= count; i += kUnroll * kLanes) {
    for (size_t u = 0; u < kUnroll; ++u) {
      block(d + i + u * kLanes, s + i + u * kLanes);
    }
  }
  for (; i + kLanes <= count; i += kLanes) {
    block(d + i, s + i);
  }
  if (i < count) {
    partial(d + i, s + i, count - i);
  }
}

template <class C, class Op>
__attribute__((flatten)) void portableKernel(void* dst, const void* src, size_t count) {
  run<16, C, Op>(dst, src, count);
}

#if defined(__x86_64__)
template <class C, class Op>
__attribute__((target("avx2,f16c"), flatten)) void avx2Kernel(
    void* dst,
    const void* src,
    size_t count) {
  run<32, C, Op>(dst, src, count);
}

template <class C, class Op>
__attribute__((target("avx512f,avx512bw"), flatten)) void avx512Kernel(
    void* dst,
    const void* src,
    size_t count) {
  run<64, C, Op>(dst, src, count);
}
#endif

template <class C, class Op>
ReduceFn kernel(Isa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::kAvx512:
      return &avx512Kernel<C, Op>;
    case Isa::kAvx2:
      return &avx2Kernel<C, Op>;
#endif
    default:
      return &portableKernel<C, Op>;
  }
}

template <class C>
ReduceFn floatKernel(ReduceKind kind, Isa isa) {
  switch (kind) {
    case ReduceKind::kSum:
      return kernel<C, Sum>(isa);
    case ReduceKind::kProduct:
      return kernel<C, Product>(isa);
    case ReduceKind::kMin:
      return kernel<C, Min>(isa);
    case ReduceKind::kMax:
      return kernel<C, Max>(isa);
    default:
      return nullptr;
  }
}

template <class T>
ReduceFn intKernel(ReduceKind kind, Isa isa) {
  using U = Plain<std::make_unsigned_t<T>>;
  switch (kind) {
    case ReduceKind::kSum:
      return kernel<U, Sum>(isa);
    case ReduceKind::kProduct:
      return kernel<U, Product>(isa);
    case ReduceKind::kMin:
      return kernel<Plain<T>, Min>(isa);
    case ReduceKind::kMax:
      return kernel<Plain<T>, Max>(isa);
    case ReduceKind::kBand:
      return kernel<U, BitAnd>(isa);
    case ReduceKind::kBor:
      return kernel<U, BitOr>(isa);
    case ReduceKind::kBxor:
      return kernel<U, BitXor>(isa);
  }
  return nullptr;
}

// torch stores bool as one byte holding 0 or 1, so the logical ops are the bitwise ones on it.
ReduceKind boolKind(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum:
    case ReduceKind::kMax:
    case ReduceKind::kBor:
      return ReduceKind::kBor;
    case ReduceKind::kProduct:
    case ReduceKind::kMin:
    case ReduceKind::kBand:
      return ReduceKind::kBand;
    case ReduceKind::kBxor:
      return ReduceKind::kBxor;
  }
  return kind;
}

} // namespace

size_t elementSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16:
      return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool:
      return 1;
  }
  return 0;
}

const char* dataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kInt8:
      return "int8";
    case DataType::kInt16:
      return "int16";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kBool:
      return "bool";
  }
  return "unknown";
}

const char* reduceKindName(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum:
      return "sum";
    case ReduceKind::kProduct:
      return "product";
    case ReduceKind::kMin:
      return "min";
    case ReduceKind::kMax:
      return "max";
    case ReduceKind::kBand:
      return "band";
    case ReduceKind::kBor:
      return "bor";
    case ReduceKind::kBxor:
      return "bxor";
  }
  return "unknown";
}

bool isFloatingPoint(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return true;
    default:
      return false;
  }
}

Isa bestIsa() {
#if defined(__x86_64__)
  static const Isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
      return Isa::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
      return Isa::kAvx2;
    }
    return Isa::kPortable;
  }();
  return best;
#else
  return Isa::kPortable;
#endif
}

const char* isaName(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

Reducer makeReducer(DataType dtype, ReduceKind kind) {
  return makeReducer(dtype, kind, bestIsa());
}

Reducer makeReducer(DataType dtype, ReduceKind kind, Isa isa) {
  Reducer reducer;
  reducer.elementSize = elementSize(dtype);
  if (isa > bestIsa()) {
    return reducer;
  }
  switch (dtype) {
    case DataType::kFloat32:
      reducer.fn = floatKernel<Plain<float>>(kind, isa);
      break;
    case DataType::kFloat64:
      reducer.fn = floatKernel<Plain<double>>(kind, isa);
      break;
    case DataType::kFloat16:
      reducer.fn = floatKernel<Half>(kind, isa);
      break;
    case DataType::kBFloat16:
      reducer.fn = floatKernel<BFloat16>(kind, isa);
      break;
    case DataType::kInt8:
      reducer.fn = intKernel<int8_t>(kind, isa);
      break;
    case DataType::kInt16:
      reducer.fn = intKernel<int16_t>(kind, isa);
      break;
    case DataType::kInt32:
      reducer.fn = intKernel<int32_t>(kind, isa);
      break;
    case DataType::kInt64:
      reducer.fn = intKernel<int64_t>(kind, isa);
      break;
    case DataType::kUInt8:
      reducer.fn = intKernel<uint8_t>(kind, isa);
      break;
    case DataType::kBool:
      reducer.fn = intKernel<uint8_t>(boolKind(kind), isa);
      break;
  }
  return reducer;
}

} // namespace torus
