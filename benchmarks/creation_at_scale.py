"""Group creation's store traffic at scale, simulated: `--ranks` ranks as threads spread over
`--processes` processes, each thread with its own client of one real TCPStore, run the store
protocol of a torus group's creation by calling torch_torus's own functions (agree_epoch, meet,
agree_settings), then the C++ side's operations: sharing the group's secret, publishing this
rank's TCP address, and, for the first collective, looking up its two ring neighbours' as the
transport does (check, then get, with its backoff while absent). Nothing else of a group is created: no socket, no thread.

Beside it, the floor on the same store: an `add` counter and one `wait` for "every rank has
arrived". Each phase starts on every rank at once after a store barrier; a rank times its own.
Creation runs twice on the same store under the same group name: the second is a re-creation,
reading past what the first left. Prints, per size, the slowest rank's time of each phase, the
store operations per rank (most, fewest) and the store's requests per second during creation:

    python benchmarks/creation_at_scale.py --ranks 256 1024 4096 --processes 8

tests/test_store_traffic.py checks that a real 8-rank creation issues the operations this
simulation issues.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import threading
import time

import torch.distributed as dist

from torch_torus.agreement import agree_settings, shared_values
from torch_torus.config import resolve
from torch_torus.topology import agree_epoch, meet, wait_for_key

TIMEOUT_S = 600.0
# The transport's backoff between looks for an address not published yet (rendezvous.cc).
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.001, 0.1


class CountingStore(dist.Store):
    """Forwards every operation to `store` and records it as (operation, key or key count)."""

    def __init__(self, store: dist.Store):
        super().__init__()
        self.store = store
        self.ops: list[tuple[str, str]] = []

    def set(self, key, value):
        self.ops.append(("set", key))
        self.store.set(key, value)

    def get(self, key):
        self.ops.append(("get", key))
        return self.store.get(key)

    def add(self, key, amount):
        self.ops.append(("add", key))
        return self.store.add(key, amount)

    def check(self, keys):
        self.ops.append(("check", ",".join(keys)))
        return self.store.check(keys)

    def wait(self, keys, timeout=None):
        self.ops.append(("wait", ",".join(keys)))
        return self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)

    def compare_set(self, key, expected, desired):
        self.ops.append(("compare_set", key))
        return self.store.compare_set(key, expected, desired)

    def multi_get(self, keys):
        self.ops.append(("multi_get", f"{len(keys)} keys"))
        return self.store.multi_get(keys)

    def multi_set(self, keys, values):
        self.ops.append(("multi_set", f"{len(keys)} keys"))
        return self.store.multi_set(keys, values)

    def delete_key(self, key):
        self.ops.append(("delete_key", key))
        return self.store.delete_key(key)

    def num_keys(self):
        self.ops.append(("num_keys", ""))
        return self.store.num_keys()


def create(store: dist.Store, rank: int, size: int, shared: dict[str, str], timeout: float = TIMEOUT_S) -> dist.Store:
    """The store operations of creating a torus group on one rank (one rank per host, over TCP),
    in the order torch_torus._create_backend and the C++ transport issue them; returns the
    group's own store (under its epoch)."""
    address = f"10.{rank >> 16 & 255}.{rank >> 8 & 255}.{rank & 255}:29500"
    epoch = agree_epoch(store, rank, size, timeout)
    group = dist.PrefixStore(f"torus/{epoch}", store)
    meet(group, rank, size, f"host{rank}", address, "")
    agree_settings(group, rank, size, shared)
    # The group's secret (transport/group_secret.cc): rank 0 sets it, the others block on it.
    if rank == 0:
        group.set("auth/secret", os.urandom(32))
    else:
        group.get("auth/secret")
    group.set(f"tcp/{rank}", address)  # TcpTransport's constructor
    return group


def look_up(group: dist.Store, peer: int, timeout: float = TIMEOUT_S) -> str:
    """A peer's address, looked up as the transport's lookUpPublished does (rendezvous.cc)."""
    key, deadline, pause = f"tcp/{peer}", time.monotonic() + timeout, _FIRST_BACKOFF_S
    while not group.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {peer} did not publish its address")
        time.sleep(pause)
        pause = min(pause * 2, _MAX_BACKOFF_S)
    return bytes(group.get(key)).decode()


def floor(store: dist.Store, rank: int, size: int, name: str, timeout: float = TIMEOUT_S) -> None:
    """The least a creation can cost: every rank counts itself in and waits for all."""
    if store.add(f"floor/{name}/arrived", 1) == size:
        store.set(f"floor/{name}/all", "")
    wait_for_key(store, f"floor/{name}/all", time.monotonic() + timeout)


def _barrier(client: dist.Store, size: int, name: str) -> None:
    if client.add(f"sim/{name}/ready", 1) == size:
        client.set(f"sim/{name}/go", "")
    client.wait([f"sim/{name}/go"], datetime.timedelta(seconds=TIMEOUT_S))


PHASES = ("floor 1", "creation", "floor 2", "re-creation")


def _simulated_rank(rank: int, size: int, port: int, connecting: threading.Semaphore, shared: dict[str, str],
                    out: dict, errors: list) -> None:
    try:
        with connecting:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=TIMEOUT_S))
        for phase in PHASES:
            counting = CountingStore(client)
            _barrier(client, size, phase)
            start = time.perf_counter()
            if phase.startswith("floor"):
                floor(counting, rank, size, phase)
                out[(rank, phase)] = (time.perf_counter() - start, len(counting.ops))
                continue
            group = create(counting, rank, size, shared)
            out[(rank, phase)] = (time.perf_counter() - start, len(counting.ops))
            for peer in ((rank - 1) % size, (rank + 1) % size):
                look_up(group, peer)
            out[(rank, phase + " and lookups")] = (time.perf_counter() - start, len(counting.ops))
    except Exception as error:  # reported by the parent, naming the rank
        errors.append(f"rank {rank}: {type(error).__name__}: {error}")


def _process(index: int, processes: int, size: int, port: int, results) -> None:
    shared = shared_values(resolve(), {})
    out: dict = {}
    errors: list[str] = []
    # A few connections at a time: thousands at once overflow the server's listen backlog.
    connecting = threading.Semaphore(16)
    threads = [threading.Thread(target=_simulated_rank, args=(r, size, port, connecting, shared, out, errors))
               for r in range(index, size, processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put((out, errors))


def simulate(size: int, processes: int) -> dict:
    """One run at `size` ranks: per phase, the slowest rank's seconds, the most and fewest store
    operations of a rank, and the store's requests per second over the slowest rank's time."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=TIMEOUT_S))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_process, args=(i, processes, size, server.port, results))
               for i in range(processes)]
    for worker in workers:
        worker.start()
    out, errors = {}, []
    for _ in workers:
        part, failed = results.get(timeout=3 * TIMEOUT_S)
        out.update(part)
        errors += failed
    for worker in workers:
        worker.join()
    if errors:
        raise RuntimeError(f"{len(errors)} simulated ranks failed, e.g. " + "; ".join(errors[:3]))
    row = {"ranks": size, "processes": processes}
    for phase in PHASES + ("creation and lookups", "re-creation and lookups"):
        times = [out[(r, phase)][0] for r in range(size)]
        ops = [out[(r, phase)][1] for r in range(size)]
        row[phase] = {"slowest_s": max(times), "ops_max": max(ops), "ops_min": min(ops),
                      "requests_per_s": sum(ops) / max(times)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print("| ranks | floor (slowest rank) | creation | ÷ floor | with the first collective's 2 lookups | "
          "re-creation | ÷ floor | store ops per rank (creation; with lookups) | store requests/s (creation) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.ranks:
        row = simulate(size, args.processes)
        rows.append(row)
        floor_s = min(row["floor 1"]["slowest_s"], row["floor 2"]["slowest_s"])
        first, looked, again = row["creation"], row["creation and lookups"], row["re-creation"]
        print(f"| {size:,} | {floor_s:.3f} s | {first['slowest_s']:.3f} s | {first['slowest_s'] / floor_s:.1f} | "
              f"{looked['slowest_s']:.3f} s | {again['slowest_s']:.3f} s | {again['slowest_s'] / floor_s:.1f} | "
              f"{first['ops_min']}-{first['ops_max']}; {looked['ops_min']}-{looked['ops_max']} | "
              f"{first['requests_per_s']:,.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
