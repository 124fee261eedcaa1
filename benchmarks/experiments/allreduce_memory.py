"""Resident memory per rank around a large allreduce, for torus and gloo in the same job.

    torchrun --nproc-per-node 4 benchmarks/experiments/allreduce_memory.py --mib 100

For each backend: RSS before the first allreduce (the tensor already allocated and touched),
the growth of the peak RSS (ru_maxrss) over `--calls` allreduces, and RSS after them. A backend
that stages whole messages shows a peak growth near the message size; torus's bounded staging
(a chunk of scratch, its rings and slots) should not.
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist

import torch_torus  # noqa: F401  (registers "torus")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / (1 << 20)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=100, help="allreduce size in MiB (float32)")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--backends", default="torus,gloo")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    lines = []
    for backend in args.backends.split(","):
        group = dist.new_group(backend=backend)
        tensor = torch.ones(args.mib << 18)
        dist.all_reduce(torch.ones(1), group=group)  # connections and segments set up
        before, peak_before = rss_mib(), peak_mib()
        for _ in range(args.calls):
            dist.all_reduce(tensor, group=group)
        after, peak_after = rss_mib(), peak_mib()
        correct = bool(tensor.eq(n ** args.calls).all())
        lines.append(f"{backend:>6} rank {rank}: rss before {before:7.1f} MiB, after {after:7.1f} MiB, "
                     f"peak grew {peak_after - peak_before:6.1f} MiB over {args.calls} x {args.mib} MiB allreduce "
                     f"(result {'correct' if correct else 'WRONG'})")
        dist.destroy_process_group(group)
        del tensor
    gathered = [None] * n
    dist.all_gather_object(gathered, lines)
    if rank == 0:
        for per_rank in zip(*gathered):
            print("\n".join(per_rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
