// Reduction kernels and their run-time dispatch.
//
// Every kernel is one template, run<W, Codec, Op>, written with GCC/Clang generic vectors and
// built three times: W = 16 bytes with no target attribute (portable: SSE2 on x86-64, NEON on
// AArch64, plain scalar code elsewhere), W = 32 under target("avx2,f16c") and W = 64 under
// target("avx512f,avx512bw"). The entry points are flattened, so the loop, the codec and the op
// are all compiled for the entry's target. makeReducer asks the CPU once
// (__builtin_cpu_supports) and hands back a plain function pointer: a call costs one indirect
// jump and no feature test.
//
// The codec reads a block of W bytes from dst and src into vectors, applies the op and writes
// dst back. Plain<T> computes in T; integer SUM, PRODUCT and bitwise ops use the unsigned twin of
// T, where wrap-around is defined (signed overflow is UB in C++). Half and BFloat16 widen to
// float and round back to nearest-even.

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

// Like torch.minimum/maximum, NaN in either input gives NaN: a comparison with NaN is false, so
// m is b when b is NaN, and a NaN a is caught by a != a (false for integers: folds away). The
// NaN case yields a + b, itself NaN, rather than a: given a, GCC 12 fuses the two selects into
// one on an OR of masks, which it scalarizes for 512-bit float vectors.
struct Min {
  template <class V>
  static void apply(V& a, const V& b) {
    V m = (a < b) ? a : b;
    a = (a != a) ? a + b : m;
  }
};

struct Max {
  template <class V>
  static void apply(V& a, const V& b) {
    V m = (a > b) ? a : b;
    a = (a != a) ? a + b : m;
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

// A codec applies Op to one block: W bytes of storage at d and at s.
template <class T>
struct Plain {
  using Storage = T;

  template <size_t W, class Op>
  static void block(T* d, const T* s) {
    Vec<T, W> a;
    Vec<T, W> b;
    memcpy(&a, d, W);
    memcpy(&b, s, W);
    Op::apply(a, b);
    memcpy(d, &a, W);
  }
};

// 16-bit floats are computed as two float vectors. Generically a block is read as 32-bit words,
// whose high halves (odd elements) and low halves (even elements) each give one float vector:
// an element-wise op does not care about lane order, and this needs no shuffles, which would
// otherwise bound the loop. Format supplies widen (16 bits at the top of a word -> float) and
// narrow (float -> 16 bits at the bottom of a word); it may also overload unpack/pack for
// one vector width, as Half does with the hardware conversions.
template <class Format>
struct Widened16 {
  using Storage = uint16_t;

  template <class V>
  static void unpack(const uint16_t* p, V& even, V& odd) {
    Vec<uint32_t, sizeof(V)> w;
    memcpy(&w, p, sizeof w);
    Format::widen(even, w << 16);
    Format::widen(odd, w & 0xFFFF0000u);
  }

  template <class V>
  static void pack(uint16_t* p, const V& even, const V& odd) {
    Vec<uint32_t, sizeof(V)> lo;
    Vec<uint32_t, sizeof(V)> hi;
    Format::narrow(lo, even);
    Format::narrow(hi, odd);
    lo |= hi << 16;
    memcpy(p, &lo, sizeof lo);
  }

  template <size_t W, class Op>
  static void block(uint16_t* d, const uint16_t* s) {
    Vec<float, W> a0;
    Vec<float, W> a1;
    Vec<float, W> b0;
    Vec<float, W> b1;
    Format::unpack(d, a0, a1);
    Format::unpack(s, b0, b1);
    Op::apply(a0, b0);
    Op::apply(a1, b1);
    Format::pack(d, a0, a1);
  }
};

struct BFloat16 : Widened16<BFloat16> {
  template <class V, class U>
  static void widen(V& v, const U& w) {
    v = __builtin_bit_cast(V, w);
  }

  // Round to nearest, ties to even; NaN becomes the quiet NaN that c10::BFloat16 writes.
  template <class U, class V>
  static void narrow(U& h, const V& v) {
    U w = __builtin_bit_cast(U, v);
    h = (v != v) ? U{} + 0x7FC0u : (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  }
};

// IEEE half. widen and narrow are the branch-free conversions of the FP16 library (also
// c10::Half's software fallback), done on all lanes at once: the portable path. x86 builds
// overload unpack/pack for the AVX2 and AVX-512 widths with the hardware conversions (F16C).
struct Half : Widened16<Half> {
  using Widened16<Half>::unpack;
  using Widened16<Half>::pack;

  template <class V, class U>
  static void widen(V& v, const U& w) {
    U twice = w + w; // the sign shifted out
    // Normal, Inf and NaN: move exponent and mantissa into place and rebias by 2^-112.
    V normal = __builtin_bit_cast(V, (twice >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    // Subnormal: build 0.5 + m * 2^-24 exactly and subtract 0.5.
    V subnormal = __builtin_bit_cast(V, (twice >> 17) | (126u << 23)) - 0.5f;
    U bits = (twice < (1u << 27)) ? __builtin_bit_cast(U, subnormal) : __builtin_bit_cast(U, normal);
    v = __builtin_bit_cast(V, (w & 0x80000000u) | bits);
  }

  template <class U, class V>
  static void narrow(U& h, const V& v) {
    U w = __builtin_bit_cast(U, v);
    U twice = w + w; // the sign shifted out
    // Scaling by 2^112 then 2^-110 sends overflow to Inf; adding a power of two aligned to the
    // half's ulp then lets the FPU round to nearest-even, subnormals included.
    V base = __builtin_bit_cast(V, w & 0x7FFFFFFFu) * 0x1.0p+112f * 0x1.0p-110f;
    U bias = twice & 0xFF000000u;
    bias = (bias < 0x71000000u) ? U{} + 0x71000000u : bias;
    U bits = __builtin_bit_cast(U, __builtin_bit_cast(V, (bias >> 1) + 0x07800000u) + base);
    U magnitude = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    h = ((w >> 16) & 0x8000u) | ((twice > 0xFF000000u) ? U{} + 0x7E00u : magnitude);
  }

#if defined(__x86_64__)
  __attribute__((target("avx2,f16c"))) static void unpack(
      const uint16_t* p,
      Vec<float, 32>& lo,
      Vec<float, 32>& hi) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  }
  __attribute__((target("avx2,f16c"))) static void pack(
      uint16_t* p,
      const Vec<float, 32>& lo,
      const Vec<float, 32>& hi) {
    __m256i h = _mm256_set_m128i(
        _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT),
        _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  // The all-lanes masked forms: GCC 12's unmasked ones trip -Wmaybe-uninitialized.
  __attribute__((target("avx512f"))) static void unpack(
      const uint16_t* p,
      Vec<float, 64>& lo,
      Vec<float, 64>& hi) {
    lo = _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    hi = _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
  __attribute__((target("avx512f"))) static void pack(
      uint16_t* p,
      const Vec<float, 64>& lo,
      const Vec<float, 64>& hi) {
    __m256i h0 = _mm512_maskz_cvtps_ph(0xFFFF, lo, _MM_FROUND_TO_NEAREST_INT);
    __m256i h1 = _mm512_maskz_cvtps_ph(0xFFFF, hi, _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), h1);
  }
#endif
};

// dst[i] = dst[i] op src[i], a block of W bytes of storage at a time.
template <size_t W, class C, class Op>
void run(void* dst, const void* src, size_t count) {
  using S = typename C::Storage;
  constexpr size_t kLanes = W / sizeof(S);

  S* d = static_cast<S*>(dst);
  const S* s = static_cast<const S*>(src);
  // Fewer than kLanes elements go through the same vector code on zero-padded copies, so every
  // element gets bit-identical treatment wherever it sits; zero is harmless to every op.
  auto partial = [](S* dd, const S* ss, size_t n) {
    S bd[kLanes] = {};
    S bs[kLanes] = {};
    memcpy(bd, dd, n * sizeof(S));
    memcpy(bs, ss, n * sizeof(S));
    C::template block<W, Op>(bd, bs);
    memcpy(dd, bd, n * sizeof(S));
  };

  // Align dst to a block so that its loads and stores never straddle cache lines (src may
  // still be misaligned relative to it: loads split more cheaply than stores).
  size_t head = (-reinterpret_cast<uintptr_t>(d) % W) / sizeof(S);
  head = head < count ? head : count;
  if (head > 0) {
    partial(d, s, head);
  }
  size_t i = head;
  for (; i + kLanes <= count; i += kLanes) {
    C::template block<W, Op>(d + i, s + i);
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

ReduceKind boolReduceKind(ReduceKind kind) {
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
      reducer.fn = intKernel<uint8_t>(boolReduceKind(kind), isa);
      break;
  }
  return reducer;
}

namespace {

template <class Enum>
std::optional<Enum> named(const std::string& name, const char* (*nameOf)(Enum), Enum last) {
  for (int i = 0; i <= static_cast<int>(last); ++i) {
    if (name == nameOf(static_cast<Enum>(i))) {
      return static_cast<Enum>(i);
    }
  }
  return std::nullopt;
}

} // namespace

std::optional<DataType> dataTypeNamed(const std::string& name) {
  return named(name, &dataTypeName, DataType::kBool);
}

std::optional<ReduceKind> reduceKindNamed(const std::string& name) {
  return named(name, &reduceKindName, ReduceKind::kBxor);
}

std::optional<Isa> isaNamed(const std::string& name) {
  return named(name, &isaName, Isa::kAvx512);
}

} // namespace torus
