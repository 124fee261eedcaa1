// Element-wise reduction kernels: dst[i] = dst[i] (op) src[i].
//
// The one place where bandwidth is won or lost: every kernel makes a single pass over memory,
// allocates nothing, and is vectorized (AVX2/AVX-512 picked at run time where the CPU has it).
// float16 and bfloat16 are widened to float, combined, and rounded back to nearest-even.
// Knows nothing of torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace torus {

enum class DataType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUInt8,
  kBool,
};

enum class ReduceKind : uint8_t {
  kSum,
  kProduct,
  kMin,
  kMax,
  kBand,
  kBor,
  kBxor,
};

size_t elementSize(DataType dtype);
const char* dataTypeName(DataType dtype);
const char* reduceKindName(ReduceKind kind);
bool isFloatingPoint(DataType dtype);

// dst[i] = dst[i] (op) src[i] for i in [0, count). dst and src must not overlap partially.
using ReduceFn = void (*)(void* dst, const void* src, size_t count);

// What a collective needs to combine two buffers of one dtype with one op.
struct Reducer {
  ReduceFn fn = nullptr;
  size_t elementSize = 0;

  void operator()(void* dst, const void* src, size_t count) const {
    fn(dst, src, count);
  }
};

// Returns the kernel for (dtype, kind), or a Reducer with fn == nullptr when the pair is not
// supported (bitwise ops on floating-point types). Bool: see boolReduceKind.
Reducer makeReducer(DataType dtype, ReduceKind kind);

// torch stores bool as one byte holding 0 or 1, so a bool reduction is the bitwise op on that
// byte: SUM and MAX are BOR, PRODUCT and MIN are BAND, BXOR stays. The CUDA kernels map bool the
// same way.
ReduceKind boolReduceKind(ReduceKind kind);

// Instruction sets the kernels are built for, narrowest first. makeReducer(dtype, kind) uses
// bestIsa(); naming one lets tests and benchmarks reach every variant on one machine.
enum class Isa : uint8_t {
  kPortable, // generic vectors of 16 bytes: SSE2 on x86-64, NEON on AArch64
  kAvx2, // AVX2 + F16C
  kAvx512, // AVX-512 F + BW
};

// The widest Isa this CPU (and this build) can run; decided once.
Isa bestIsa();
const char* isaName(Isa isa);

// As makeReducer(dtype, kind), built for isa; fn == nullptr also when isa is wider than bestIsa().
Reducer makeReducer(DataType dtype, ReduceKind kind, Isa isa);

// The dtype, op or instruction set that dataTypeName, reduceKindName or isaName calls `name`;
// nullopt for a name none of them has.
std::optional<DataType> dataTypeNamed(const std::string& name);
std::optional<ReduceKind> reduceKindNamed(const std::string& name);
std::optional<Isa> isaNamed(const std::string& name);

} // namespace torus
