#include "reduce/streaming_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace torus {

#if defined(__x86_64__)
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kPages = 4;
constexpr size_t kLine = 64;

// One line from src to dst with non-temporal stores (SSE2: every x86-64 has it).
inline void streamLine(char* dst, const char* src) {
  const __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(src + 16));
  const __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(src + 32));
  const __m128i d = _mm_load_si128(reinterpret_cast<const __m128i*>(src + 48));
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
}

} // namespace
#endif

void streamingCopy(void* dst, const void* src, size_t nbytes) {
  char* to = static_cast<char*>(dst);
  const char* from = static_cast<const char*>(src);
#if defined(__x86_64__)
  const bool aligned = (reinterpret_cast<uintptr_t>(to) | reinterpret_cast<uintptr_t>(from)) % 16 == 0;
  const size_t bulk = aligned ? nbytes / (kPages * kPage) * (kPages * kPage) : 0;
  // Interleaving four pages keeps four streams of writes open at once.
  for (size_t base = 0; base < bulk; base += kPages * kPage) {
    for (size_t offset = 0; offset < kPage; offset += kLine) {
      for (size_t page = 0; page < kPages; ++page) {
        const size_t at = base + page * kPage + offset;
        streamLine(to + at, from + at);
      }
    }
  }
  _mm_sfence(); // the streamed stores are ordered before whatever follows
  to += bulk;
  from += bulk;
  nbytes -= bulk;
#endif
  std::memcpy(to, from, nbytes);
}

} // namespace torus
