"""Per-call time and context switches of small allreduces in a tight loop, on rank 0.

    torchrun --nproc-per-node 2 benchmarks/experiments/small_call_switches.py --algorithm ring

What a helper thread costs shows here and nowhere else: a wake-up per collective adds a
voluntary context switch per call (getrusage counts every thread of the process), which the
bench's per-call times bury in the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.distributed as dist

import torch_torus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default=torch_torus.algorithms.SHARED_MEMORY[0],
                        help="TORUS_ALLREDUCE value (default: %(default)s)")
    parser.add_argument("--bytes", type=int, default=4096, help="allreduce size (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best counts (default: %(default)s)")
    args = parser.parse_args()

    dist.init_process_group("torus")
    group = dist.new_group(backend="torus", pg_options=torch_torus.Options(allreduce=args.algorithm))
    tensor = torch.ones(max(1, args.bytes // 4))
    for _ in range(200):
        dist.all_reduce(tensor, group=group)
    best, switches = float("inf"), (0.0, 0.0)
    for _ in range(args.rounds):
        dist.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        for _ in range(args.calls):
            dist.all_reduce(tensor, group=group)
        seconds = (time.perf_counter() - start) / args.calls
        after = resource.getrusage(resource.RUSAGE_SELF)
        if seconds < best:
            best = seconds
            switches = ((after.ru_nvcsw - before.ru_nvcsw) / args.calls, (after.ru_nivcsw - before.ru_nivcsw) / args.calls)
    if dist.get_rank() == 0:
        print(f"{args.algorithm} {args.bytes} B, {dist.get_world_size()} ranks: best {best * 1e6:.1f} us per call; "
              f"context switches per call on rank 0: voluntary {switches[0]:.2f}, involuntary {switches[1]:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
