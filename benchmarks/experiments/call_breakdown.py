"""Where a small collective's time goes: per-call cost of all_reduce through each layer, in one
interleaved run.

    torchrun --nproc-per-node 2 benchmarks/experiments/call_breakdown.py --bytes 4K

Each row is a way of calling a float32 all_reduce, timed in a tight loop (after a barrier) and
reported as µs per call on the slowest rank, median over rounds; every round runs the rows in a
new order, so that drift of a shared machine hits every row alike. Differences between rows
price the layers:

  fake                  torch's fake backend: torch's own dispatch (Python wrapper, c10d op
                        dispatch, a Work), a backend that does nothing: the floor of any backend
  torus, one rank       torus on a single-rank group: our per-call cost without peers (checks,
                        Work and future, the executor; the algorithm returns at once)
  torus, one rank, async torus on a single-rank group with async_op=True and wait(): the call
                        queued to the group's worker thread and waited for (the hand-off)
  torus, all ranks      dist.all_reduce on the whole group
  torus, async          async_op=True then wait(): always through the worker thread
  torus op              torch.ops.torus.all_reduce_: no ProcessGroup dispatch, no Work
  gloo                  gloo on the whole group, for reference
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  (registers "fake")

import torch_torus
from torch_torus.bench.sizes import parse_size


def timed_loop(call, calls: int) -> float:
    """Seconds per call over `calls` calls, started together after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def rows(tensor: torch.Tensor, with_gloo: bool) -> dict:
    fake = dist.new_group(backend="fake")
    solo, _ = dist.new_subgroups(group_size=1, backend="torus")
    table = {
        "fake": lambda: dist.all_reduce(tensor, group=fake),
        "torus, one rank": lambda: dist.all_reduce(tensor, group=solo),
        "torus, one rank, async": lambda: dist.all_reduce(tensor, group=solo, async_op=True).wait(),
        "torus, all ranks": lambda: dist.all_reduce(tensor),
        "torus, async": lambda: dist.all_reduce(tensor, async_op=True).wait(),
    }
    op, name = torch.ops.torus.all_reduce_, dist.group.WORLD.group_name
    table["torus op"] = lambda: op(tensor, name)
    if with_gloo:
        gloo = dist.new_group(backend="gloo")
        table["gloo"] = lambda: dist.all_reduce(tensor, group=gloo)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=parse_size, default=parse_size("4K"), help="message size (default: 4K)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per row and round (default: 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    parser.add_argument("--no-gloo", action="store_true", help="leave gloo out (it is slow at 8 ranks)")
    args = parser.parse_args()

    dist.init_process_group("torus")
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.ones(args.bytes // 4)
    table = rows(tensor, not args.no_gloo)
    for call in table.values():
        for _ in range(50):
            call()
    order = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in table}
    for round_ in range(args.rounds):
        names = list(table)
        order.shuffle(names)
        for name in names:
            seconds = torch.tensor([timed_loop(table[name], args.calls)], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            times[name].append(seconds.item())
        if rank == 0:
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    if rank == 0:
        floor = statistics.median(times["fake"])
        print(f"\nall_reduce of {args.bytes} bytes, {world} ranks, {os.cpu_count()} cores, "
              f"torus runs {torch_torus.algorithm_for('allreduce', args.bytes)}; "
              f"µs per call, slowest rank, median of {args.rounds} rounds of {args.calls} calls")
        print(f"{'row':<24}{'µs':>9}{'over fake':>11}   rounds")
        for name, samples in times.items():
            median = statistics.median(samples)
            spread = " ".join(f"{s * 1e6:.1f}" for s in samples)
            print(f"{name:<24}{median * 1e6:>9.1f}{(median - floor) * 1e6:>+11.1f}   {spread}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
