"""new_group over each transport, in one run: `--ranks` processes on this host share one
TCPStore and a torus default group; each transport's ranks then create a group of every rank,
run one 4-element all_reduce in it, destroy it and drop it, `--cycles` times. Prints, per
transport, the median over the cycles of the slowest rank's new_group, and of the slowest rank's
release of the destroyed group (where the TCP transport's farewells wait).

    python benchmarks/creation_cycles.py --ranks 4 --cycles 20 --transports tcp shm
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, size: int, port: int, transport: str, cycles: int, results) -> None:
    os.environ["TORUS_TRANSPORT"] = transport
    import torch_torus  # noqa: F401 (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("torus", store=store, rank=rank, world_size=size)
    rows = []
    for _ in range(cycles):
        start = time.perf_counter()
        group = dist.new_group(list(range(size)))
        created = time.perf_counter()
        dist.all_reduce(torch.ones(4), group=group)
        dist.destroy_process_group(group)
        destroyed = time.perf_counter()
        del group
        rows.append((created - start, time.perf_counter() - destroyed))
    results.put((rank, rows))
    dist.destroy_process_group()


def gather_ranks(worker, size: int, *args) -> list:
    """Runs worker(rank, size, port, *args, results) in `size` spawned processes, `port` a free
    one for their TCPStore; what each put on `results`."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=worker, args=(r, size, port, *args, results)) for r in range(size)]
    for process in workers:
        process.start()
    by_rank = [results.get(timeout=600) for _ in workers]
    for process in workers:
        process.join()
    return by_rank


def run(transport: str, size: int, cycles: int) -> tuple[float, float]:
    """(median of the slowest rank's new_group, median of its release), seconds."""
    by_rank = gather_ranks(_worker, size, transport, cycles)
    per_cycle = [[rows[c] for _, rows in by_rank] for c in range(cycles)]
    return (statistics.median(max(r[0] for r in cycle) for cycle in per_cycle),
            statistics.median(max(r[1] for r in cycle) for cycle in per_cycle))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--transports", nargs="+", default=["tcp", "shm"])
    args = parser.parse_args()
    print(f"{args.ranks} ranks, {args.cycles} cycles; medians over the cycles of the slowest rank")
    print("| transport | new_group (ms) | release of the destroyed group (ms) |")
    print("|---|---:|---:|")
    for transport in args.transports:
        create, release = run(transport, args.ranks, args.cycles)
        print(f"| {transport} | {create * 1e3:.1f} | {release * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
