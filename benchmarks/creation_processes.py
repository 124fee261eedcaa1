"""Real group creation, torus against gloo in one run: for each size, `--ranks` processes on this
host share one TCPStore, wrapped in a store that counts every operation
(creation_at_scale.CountingStore); after a store barrier each calls init_process_group and runs
one 4-element all_reduce. Prints, per size and backend, the slowest rank's init_process_group
and the busiest rank's store operations (creation and the all_reduce, torch's own included).
The backends alternate size by size.

    python benchmarks/creation_processes.py --ranks 8 32 64
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from creation_at_scale import CountingStore  # noqa: E402

from torch_torus import BACKEND_NAME  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=600)


def _worker(rank: int, size: int, port: int, backend: str, results) -> None:
    import torch_torus  # noqa: F401 (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=TIMEOUT)
    if store.add("bench/ready", 1) == size:
        store.set("bench/go", "")
    store.wait(["bench/go"])
    counting = CountingStore(store)
    start = time.perf_counter()
    dist.init_process_group(backend, store=counting, rank=rank, world_size=size, timeout=TIMEOUT)
    created = time.perf_counter() - start
    dist.all_reduce(torch.ones(4))
    results.put((rank, created, len(counting.ops)))
    dist.destroy_process_group()


def run(backend: str, size: int) -> tuple[float, int]:
    """(the slowest rank's init_process_group in seconds, the busiest rank's store operations)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_worker, args=(r, size, port, backend, results)) for r in range(size)]
    for worker in workers:
        worker.start()
    rows = [results.get(timeout=900) for _ in workers]
    for worker in workers:
        worker.join()
    return max(r[1] for r in rows), max(r[2] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--transport", default="tcp", help="TORUS_TRANSPORT for the torus groups")
    args = parser.parse_args()
    os.environ["TORUS_TRANSPORT"] = args.transport
    print("| ranks | gloo init_process_group | torus | torus ÷ gloo | store ops, busiest rank: gloo | torus |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in args.ranks:
        gloo_s, gloo_ops = run("gloo", size)
        torus_s, torus_ops = run(BACKEND_NAME, size)
        print(f"| {size} | {gloo_s:.2f} s | {torus_s:.2f} s | {torus_s / gloo_s:.2f} | {gloo_ops} | {torus_ops} |",
              flush=True)


if __name__ == "__main__":
    main()
