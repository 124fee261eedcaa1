"""The flight recorder's cost on a small all_reduce, on and off in one interleaved run (issue 40).

    torchrun --standalone --nproc-per-node 2 benchmarks/recorder_overhead.py --rounds 40 --calls 2000

Two groups over the same ranks, one recording (TORUS_TRACE_BUFFER=2000, the default) and one not
(0), take turns: each round times --calls back-to-back synchronous all_reduces of --bytes on each,
in alternating order, so that the machine's drift hits both alike. --control makes both groups
non-recording: what the two groups differ by without the recorder (their memory, their order of
creation), the floor under which a measured cost means nothing. Rank 0 prints each group's median
time per call over the rounds (the slowest rank's, per round), the ratio, and the spread of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import torch_torus


def timed(group, tensor, calls: int) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(tensor, group=group)
    elapsed = torch.tensor([(time.perf_counter() - start) / calls])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--control", action="store_true", help="both groups without the recorder (an A/A run)")
    parser.add_argument("--buffer", type=int, default=2000, help="the recording group's TORUS_TRACE_BUFFER")
    args = parser.parse_args()
    dist.init_process_group("torus")
    groups = {"on": dist.new_group(backend="torus",
                                   pg_options=torch_torus.Options(trace_buffer=0 if args.control else args.buffer)),
              "off": dist.new_group(backend="torus", pg_options=torch_torus.Options(trace_buffer=0))}
    tensor = torch.ones(args.bytes // 4)
    for group in groups.values():  # warm-up: the ring goes round once
        timed(group, tensor, max(args.calls, 2100))
    times = {name: [] for name in groups}
    for r in range(args.rounds):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            times[name].append(timed(groups[name], tensor, args.calls))
    if dist.get_rank() == 0:
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        ratios = sorted(a / b for a, b in zip(times["on"], times["off"]))
        quartiles = statistics.quantiles(ratios, n=4)
        print(f"{'control (both off): ' if args.control else ''}{dist.get_world_size()} ranks, {args.bytes} B, {args.rounds} rounds x {args.calls} calls: "
              f"recorder on {on * 1e6:.2f} us, off {off * 1e6:.2f} us per call (median of rounds); "
              f"on/off {on / off:.4f}; per-round ratio quartiles {quartiles[0]:.4f} {quartiles[1]:.4f} "
              f"{quartiles[2]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
