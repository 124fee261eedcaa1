// streamingCopy: a copy whose stores go around the caches (non-temporal), so that the memory sees
// each byte read once and written once. A plain copy first reads every line it writes (to own it),
// a third pass that the bytes it counts leave out: on the 2-core machine of BENCHMARKS.md two
// processes copying 64 MiB moved 27 GB/s (read + written) with plain stores and 44-46 GB/s with
// these. The bench's memory bound is the faster of the two (bench/memory_bound.py): a bound
// must be the most the memory moves. Knows nothing of torch.
#pragma once

#include <cstddef>

namespace torus {

// Copies nbytes from src to dst (which must not overlap). Four pages at a time, interleaved, as
// glibc's memcpy does for copies above its non-temporal threshold; where dst or src is not
// 16-byte aligned, or off x86-64, a plain memcpy.
void streamingCopy(void* dst, const void* src, size_t nbytes);

} // namespace torus
