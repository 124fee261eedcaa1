/* A madvise() that refuses MADV_COLLAPSE (25) as a kernel before Linux 6.1 does, to preload
 * into a run of the bench: the same build with and without shared memory's huge-page moves
 * (HugePageBacking), alternating (BENCHMARKS.md, "Huge pages under the single copies"):
 *
 *   gcc -shared -fPIC -O2 -o /tmp/no_collapse.so benchmarks/no_collapse.c
 *   LD_PRELOAD=/tmp/no_collapse.so torchrun --standalone --nproc-per-node 4 -m torch_torus.bench ...
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

int madvise(void* addr, size_t length, int advice) {
  if (advice == 25) {
    errno = EINVAL;
    return -1;
  }
  return (int)syscall(SYS_madvise, addr, length, advice);
}
