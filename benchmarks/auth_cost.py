"""What the group's secret costs (issue 39): two builds of torch-torus taking turns, over TCP, at
group creation and on a 4 KiB all_reduce.

    python benchmarks/auth_cost.py --old ../parent-checkout --new . --rounds 8

Each round runs each build once (old, new; the order alternating between rounds), as `--ranks`
processes sharing one TCPStore with PYTHONPATH set to that build's source tree (its extension
built in place). A run creates a TCP group of every rank `--cycles` times: new_group, then its
first all_reduce (which makes the connections, handshakes included), then `--calls` 4 KiB
all_reduces back to back, then destroys it. Per run: the medians over the cycles of the slowest
rank's new_group, first all_reduce, both together, and mean 4 KiB call. Prints each build's median over the rounds
and new / old, with the quartiles of the per-round ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FIELDS = ("new_group_ms", "first_all_reduce_ms", "created_and_connected_ms", "call_4k_us")


def _worker(rank: int, size: int, port: int, cycles: int, calls: int, results) -> None:
    import torch
    import torch.distributed as dist

    import torch_torus  # noqa: F401 (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("torus", store=store, rank=rank, world_size=size)
    rows = []
    data = torch.ones(1024)
    for _ in range(cycles):
        start = time.perf_counter()
        group = dist.new_group(list(range(size)), pg_options=torch_torus.Options(transport="tcp"))
        created = time.perf_counter()
        dist.all_reduce(data, group=group)
        connected = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(data, group=group)
        done = time.perf_counter()
        dist.destroy_process_group(group)
        rows.append(((created - start) * 1e3, (connected - created) * 1e3, (connected - start) * 1e3,
                     (done - connected) / calls * 1e6))
    results.put((rank, rows))
    dist.destroy_process_group()


def one_build(size: int, cycles: int, calls: int) -> dict[str, float]:
    """One run of the build on PYTHONPATH: the medians over the cycles of the slowest rank."""
    from creation_cycles import gather_ranks

    by_rank = gather_ranks(_worker, size, cycles, calls)
    return {field: statistics.median(max(rows[c][i] for _, rows in by_rank) for c in range(cycles))
            for i, field in enumerate(FIELDS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="source tree of the old build")
    parser.add_argument("--new", type=Path, help="source tree of the new build")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--one-build", action="store_true", help="(internal) run the build on PYTHONPATH once")
    args = parser.parse_args()
    if args.one_build:
        print(json.dumps(one_build(args.ranks, args.cycles, args.calls)))
        return
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for index in range(args.rounds):
        for build in ("old", "new") if index % 2 == 0 else ("new", "old"):
            tree = (args.old if build == "old" else args.new).resolve()
            out = subprocess.run([sys.executable, __file__, "--one-build", f"--ranks={args.ranks}",
                                  f"--cycles={args.cycles}", f"--calls={args.calls}"],
                                 env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True,
                                 text=True).stdout
            runs[build].append(json.loads(out.splitlines()[-1]))
            print(f"round {index + 1}/{args.rounds} {build}: {runs[build][-1]}", file=sys.stderr, flush=True)
    print("| measure | old | new | new / old | per-round new / old, quartiles |")
    print("|---|---:|---:|---:|---|")
    for field in FIELDS:
        old = statistics.median(r[field] for r in runs["old"])
        new = statistics.median(r[field] for r in runs["new"])
        ratios = [n[field] / o[field] for n, o in zip(runs["new"], runs["old"])]
        quartiles = ", ".join(f"{q:.3f}" for q in statistics.quantiles(ratios, n=4))
        print(f"| {field} | {old:.3f} | {new:.3f} | {new / old:.3f} | {quartiles} |")


if __name__ == "__main__":
    main()
