/* The ceiling of an allreduce between buffers that every rank maps, with no library around it
 * (issue 42): n processes on one host, each owning S bytes of float32 in one shared mapping; each
 * reduces its block (S/n) chunk by chunk from every buffer into its own, then copies the chunk
 * into every peer's buffer, between two barriers: what torus's two_shot does over tensors from
 * allocate_tensor, less the library. Prints the best and mean time per call.
 *
 *   gcc -O3 -march=native -o /tmp/shared_buffer_ceiling benchmarks/shared_buffer_ceiling.c
 *   /tmp/shared_buffer_ceiling RANKS MIB CALLS CHUNK_KIB [streaming]
 *
 * "streaming" writes the peers' chunks with non-temporal stores, four pages interleaved.
 * The mapping asks for huge pages: shared memory gets them where
 * /sys/kernel/mm/transparent_hugepage/shmem_enabled is "advise" or wider. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
  _Atomic unsigned count;
  _Atomic unsigned generation;
} Barrier;

/* Spins briefly, then sleeps on a futex: more processes than cores. */
static void barrier(Barrier* b, int n) {
  unsigned generation = atomic_load(&b->generation);
  if (atomic_fetch_add(&b->count, 1) == (unsigned)n - 1) {
    atomic_store(&b->count, 0);
    atomic_fetch_add(&b->generation, 1);
    syscall(SYS_futex, &b->generation, FUTEX_WAKE, 1 << 30, 0, 0, 0);
    return;
  }
  for (int i = 0; i < 200; i++) {
    if (atomic_load(&b->generation) != generation) return;
    _mm_pause();
  }
  while (atomic_load(&b->generation) == generation)
    syscall(SYS_futex, &b->generation, FUTEX_WAIT, generation, 0, 0, 0);
}

static void streamingCopy(char* dst, const char* src, size_t n) {
  const size_t page = 4096;
  for (size_t base = 0; base + 4 * page <= n; base += 4 * page)
    for (size_t offset = 0; offset < page; offset += 64)
      for (int k = 0; k < 4; k++)
        for (int part = 0; part < 64; part += 16)  /* one whole line at a time */
          _mm_stream_si128((__m128i*)(dst + base + k * page + offset + part),
                           _mm_load_si128((const __m128i*)(src + base + k * page + offset + part)));
  memcpy(dst + n / (4 * page) * (4 * page), src + n / (4 * page) * (4 * page), n % (4 * page));
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s RANKS MIB CALLS CHUNK_KIB [streaming]\n", argv[0]);
    return 2;
  }
  const int n = atoi(argv[1]), calls = atoi(argv[3]);
  const size_t bytes = (size_t)atoi(argv[2]) << 20, chunk = (size_t)atoi(argv[4]) << 10 >> 2;
  const int streaming = argc > 5 && strcmp(argv[5], "streaming") == 0;
  if (n < 2 || n > 64 || calls < 3 || chunk == 0 || bytes % (4 * (size_t)n) != 0) {
    fprintf(stderr, "RANKS in 2..64, CALLS >= 3, CHUNK_KIB >= 1, MIB divisible into RANKS blocks\n");
    return 2;
  }
  const size_t count = bytes / 4;
  float* all = mmap(0, n * bytes + 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  madvise(all, n * bytes, MADV_HUGEPAGE);
  Barrier* bar = (Barrier*)((char*)all + n * bytes);
  for (int r = 0; r < n; r++) {
    if (fork() != 0) continue;
    float* buffers[64];
    for (int i = 0; i < n; i++) buffers[i] = all + i * count;
    float* own = buffers[r];
    for (size_t j = 0; j < count; j++) own[j] = 1;
    const size_t block = count / n, lo = r * block, hi = lo + block;
    double best = 1e9, total = 0;
    for (int call = 0; call < calls; call++) {
      barrier(bar, n);
      const double start = now();
      barrier(bar, n);
      for (size_t c = lo; c < hi; c += chunk) {
        const size_t e = c + chunk < hi ? c + chunk : hi;
        for (int k = 1; k < n; k++) {
          const float* theirs = buffers[(r + k) % n];
          for (size_t j = c; j < e; j++) own[j] += theirs[j];
        }
        for (int k = 1; k < n; k++) {
          float* theirs = buffers[(r + k) % n];
          if (streaming)
            streamingCopy((char*)(theirs + c), (const char*)(own + c), (e - c) * 4);
          else
            memcpy(theirs + c, own + c, (e - c) * 4);
        }
      }
      if (streaming) _mm_sfence();
      barrier(bar, n);
      const double t = now() - start;
      if (call >= 2) {  /* the first two touch the pages */
        best = t < best ? t : best;
        total += t;
      }
    }
    if (r == 0)
      printf("%d ranks, %zu MiB, %zu KiB chunks, %s stores: best %.2f ms, mean %.2f ms\n", n, bytes >> 20,
             chunk * 4 >> 10, streaming ? "streaming" : "plain", best * 1e3, total / (calls - 2) * 1e3);
    fflush(stdout);
    _exit(0);
  }
  while (wait(0) > 0) {}
  return 0;
}
