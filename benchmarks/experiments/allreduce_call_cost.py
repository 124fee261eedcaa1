"""Wall time and CPU time per dist.all_reduce call in a tight loop: what small-message latency
costs when ranks share cores.

    TORUS_ALLREDUCE=one_shot torchrun --nproc-per-node 4 benchmarks/experiments/allreduce_call_cost.py

Each rank runs --warmup then --calls all_reduce calls of --elements float32 and prints the mean
wall time and the mean CPU time of its process (all threads) per call.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import torch_torus  # noqa: F401  (registers "torus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="torus")
    parser.add_argument("--elements", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    tensor = torch.ones(args.elements)
    for _ in range(args.warmup):
        dist.all_reduce(tensor)
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(args.calls):
        dist.all_reduce(tensor)
    wall = (time.perf_counter() - wall) / args.calls
    cpu = (time.process_time() - cpu) / args.calls
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, f"rank {dist.get_rank()}: {wall * 1e6:.1f} us wall, {cpu * 1e6:.1f} us CPU per call")
    if dist.get_rank() == 0:
        print(f"{args.backend}, {dist.get_world_size()} ranks, {args.elements * 4} bytes:")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
