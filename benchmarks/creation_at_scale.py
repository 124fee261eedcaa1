"""Group creation's store traffic at scale, simulated: `--ranks` ranks as threads spread over
`--processes` processes, each thread with its own client of one real TCPStore, run the store
protocol of a torus group's creation by calling torch_torus's own functions (torch_torus.meet:
the one round in which the ranks agree on the epoch, meet and compare settings, and rank 0
publishes every rank's TCP address; publish_secret), then, for the first collective, looking up
its two ring neighbours' addresses as the C++ transport's PublishedLookups does (a wait for
the key, then a read). Nothing else of a group is created: no socket, no thread.

Beside it, the floor on the same store: an `add` counter and one `wait` for "every rank has
arrived"; and the least meeting: the floor with a record set by every rank and an answer read by
every rank after its wait, the least any meeting that carries records and answers costs on a
TCPStore, whose `wait` returns no value. Each phase starts on every rank at once after a store
barrier; a rank times its own. Floor, least meeting and creation run in turn, `--repeats` times,
on the same store under the same group name: the first creation creates the group, the later
ones create it again, reading past what the earlier ones left. Prints, per size, the median over
the repeats of the slowest rank's time of each (and the first creation's), the store operations
per rank (fewest-most) and the store's requests per second during creation:

    python benchmarks/creation_at_scale.py --ranks 256 1024 4096 --processes 32

--timeline adds, per size, the last creation operation by operation (when each kind of store
operation started and ended on every rank): where the time goes.

tests/test_store_traffic.py checks that a real 8-rank creation issues the operations this
simulation issues.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing
import re
import socket
import threading
import time

import torch.distributed as dist

from torch_torus import meet, publish_secret
from torch_torus.config import resolve
from torch_torus.topology import wait_for_key

TIMEOUT_S = 600.0
# The store's listen backlog (the kernel caps it at net.core.somaxconn), and how many simulated
# ranks of one process connect to it at once.
_BACKLOG, _CONNECTING = 4096, 32


class CountingStore(dist.Store):
    """Forwards every operation to `store` and records it as (operation, key or key count), with
    when it started and ended (time.monotonic(), the same clock in every process)."""

    def __init__(self, store: dist.Store):
        super().__init__()
        self.store = store
        self.ops: list[tuple[str, str]] = []
        self.spans: list[tuple[float, float]] = []

    def _count(self, op: str, shown: str, run):
        start = time.monotonic()
        self.ops.append((op, shown))
        try:
            return run()
        finally:
            self.spans.append((start, time.monotonic()))

    def set(self, key, value):
        return self._count("set", key, lambda: self.store.set(key, value))

    def get(self, key):
        return self._count("get", key, lambda: self.store.get(key))

    def add(self, key, amount):
        return self._count("add", key, lambda: self.store.add(key, amount))

    def check(self, keys):
        return self._count("check", ",".join(keys), lambda: self.store.check(keys))

    def wait(self, keys, timeout=None):
        return self._count("wait", ",".join(keys),
                           lambda: self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout))

    def compare_set(self, key, expected, desired):
        return self._count("compare_set", key, lambda: self.store.compare_set(key, expected, desired))

    def multi_get(self, keys):
        return self._count("multi_get", f"{len(keys)} keys", lambda: self.store.multi_get(keys))

    def multi_set(self, keys, values):
        return self._count("multi_set", f"{len(keys)} keys", lambda: self.store.multi_set(keys, values))

    def delete_key(self, key):
        return self._count("delete_key", key, lambda: self.store.delete_key(key))

    def num_keys(self):
        return self._count("num_keys", "", lambda: self.store.num_keys())


def create(store: dist.Store, rank: int, size: int, values: dict, timeout: float = TIMEOUT_S) -> dist.Store:
    """The store operations of creating a torus group on one rank (one rank per host, over TCP,
    its listener opened before the ranks meet), in the order torch_torus._create_backend and the
    C++ transport issue them; returns the group's own store (under its epoch)."""
    address = f"10.{rank >> 16 & 255}.{rank >> 8 & 255}.{rank & 255}"
    result = meet(store, rank, size, values, f"host{rank}", address, None, timeout, "simulated", f"{address}:29500")
    group = dist.PrefixStore(f"torus/{result['epoch']}", store)
    if rank == 0:
        publish_secret(group, bytes.fromhex(result["secret"]))
    # The arrival board's key, set at creation so that a failure's one batched read finds every
    # rank's (csrc/backend/arrival_board.cc).
    group.set(f"torus/reached/{rank}", "0")
    return group


def look_up(group: dist.Store, peer: int, timeout: float = TIMEOUT_S) -> str:
    """A peer's address, looked up as the transport's PublishedLookups does (StoreRendezvous in
    transport_factory.cc): a wait for its key, then a read of it (topology.read_key)."""
    return wait_for_key(group, f"tcp/{peer}", time.monotonic() + timeout, read=True)


def floor(store: dist.Store, rank: int, size: int, name: str, timeout: float = TIMEOUT_S) -> None:
    """The least a creation can cost: every rank counts itself in and waits for all."""
    if store.add(f"floor/{name}/arrived", 1) == size:
        store.set(f"floor/{name}/all", "")
    wait_for_key(store, f"floor/{name}/all", time.monotonic() + timeout)


def least_meeting(store: dist.Store, rank: int, size: int, name: str, timeout: float = TIMEOUT_S) -> None:
    """The least a meeting that carries records and answers costs on this store, whatever its
    protocol: every rank leaves its record (a `set`, answered by nothing) and counts itself in;
    the last to arrive sets the answer; every rank waits for it and reads it (TCPStore's `wait`
    returns no value). Nothing keeps out a rank of an earlier attempt, and nobody reads the
    records: a lower bound, not a protocol."""
    store.set(f"least/{name}/record/{rank}", f"host{rank}")
    if store.add(f"least/{name}/arrived", 1) == size:
        store.set(f"least/{name}/answer", "0")
    wait_for_key(store, f"least/{name}/answer", time.monotonic() + timeout, read=True)


def _barrier(client: dist.Store, size: int, name: str) -> None:
    if client.add(f"sim/{name}/ready", 1) == size:
        client.set(f"sim/{name}/go", "")
    client.wait([f"sim/{name}/go"], datetime.timedelta(seconds=TIMEOUT_S))


# What creation is measured against, by phase name: functions of (store, rank, size, phase).
LOWER_BOUNDS = {"floor": floor, "least meeting": least_meeting}


def phases(repeats: int) -> list[str]:
    """The lower bounds and creation in turn, `repeats` times: creation 1 creates the group, the
    later ones create it again under the same name (the keys of the earlier ones still in the store)."""
    return [f"{what} {i}" for i in range(1, repeats + 1) for what in (*LOWER_BOUNDS, "creation")]


def _simulated_rank(rank: int, size: int, port: int, connecting: threading.Semaphore, values: dict,
                    repeats: int, out: dict, errors: list) -> None:
    try:
        with connecting:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=TIMEOUT_S))
        for phase in phases(repeats):
            counting = CountingStore(client)
            _barrier(client, size, phase)
            start = time.perf_counter()
            bound = LOWER_BOUNDS.get(phase.rpartition(" ")[0])
            if bound:
                bound(counting, rank, size, phase)
                out[(rank, phase)] = (time.perf_counter() - start, len(counting.ops))
                continue
            group = create(counting, rank, size, values)
            out[(rank, phase)] = (time.perf_counter() - start, len(counting.ops))
            for peer in ((rank - 1) % size, (rank + 1) % size):
                look_up(group, peer)
            out[(rank, phase + " and lookups")] = (time.perf_counter() - start, len(counting.ops))
            out[(rank, "timeline")] = [(op, _key_kind(key), *span) for (op, key), span in zip(counting.ops, counting.spans)]
    except Exception as error:  # reported by the parent, naming the rank
        errors.append(f"rank {rank}: {type(error).__name__}: {error}")


def _key_kind(keys: str) -> str:
    """Keys (comma-separated) with their numbers and the group's epoch left out: what kind of
    keys they are, and how many."""
    every = keys.split(",")
    kinds = sorted({re.sub(r"\d+", "N", re.sub(r"\d+-[0-9a-f]{16}", "EPOCH", key)) for key in every})
    return ", ".join(kinds) + (f" ({len(every)} keys)" if len(every) > 1 else "")


def timeline(out: dict, size: int) -> list[str]:
    """The last creation, with its lookups, as every rank's operations of each kind saw it: how
    many, when they started and ended (seconds after the first rank's first operation), and how
    long one took (median). Where the time goes at scale."""
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rank in range(size):
        for op, kind, start, end in out[(rank, "timeline")]:
            spans.setdefault((op, kind), []).append((start, end))
    zero = min(start for kinds in spans.values() for start, _ in kinds)
    lines = ["| operation | key | count | started (first-last) | ended (first, median, last) | one takes (median) |",
             "|---|---|---:|---|---|---:|"]
    for (op, kind), kinds in sorted(spans.items(), key=lambda item: min(start for start, _ in item[1])):
        starts = sorted(start - zero for start, _ in kinds)
        ends = sorted(end - zero for _, end in kinds)
        took = _median([end - start for start, end in kinds])
        lines.append(f"| {op} | {kind} | {len(kinds):,} | {starts[0]:.3f}-{starts[-1]:.3f} s | "
                     f"{ends[0]:.3f}, {_median(ends):.3f}, {ends[-1]:.3f} s | {took * 1e3:.1f} ms |")
    return lines


def _process(index: int, processes: int, size: int, repeats: int, port: int, results) -> None:
    values = resolve()
    # Hundreds of simulated ranks share this process and its interpreter lock: a collection of
    # the whole heap (torch's included) stops them all for a good part of a second, where each
    # real rank would spend its own, far smaller, collections on its own core. Nothing here
    # makes cycles worth collecting.
    gc.collect()
    gc.freeze()
    gc.disable()
    out: dict = {}
    errors: list[str] = []
    # A few connections at a time per process: thousands at once would overflow the listen backlog.
    connecting = threading.Semaphore(_CONNECTING)
    threads = [threading.Thread(target=_simulated_rank, args=(r, size, port, connecting, values, repeats, out, errors))
               for r in range(index, size, processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put((out, errors))


def simulate(size: int, processes: int, repeats: int) -> dict:
    """One run at `size` ranks: per phase, the slowest rank's seconds, the most and fewest store
    operations of a rank, and the store's requests per second over the slowest rank's time."""
    # The store listens on an IPv4 socket of ours: on its own (dual-stack IPv6) socket it sees each
    # client as ::ffff:127.0.0.1, which /etc/hosts does not name, and looks that up in DNS on
    # its one thread as it accepts the client; where the DNS server drops a query now and then
    # (here: one in ~50), the whole store stops for the resolver's 5 s timeout each time, and
    # thousands of clients never all connect. (Each client still looks the store's address up
    # once, on its own thread.)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(_BACKLOG)
    server = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=TIMEOUT_S), master_listen_fd=listener.fileno())
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_process, args=(i, processes, size, repeats, server.port, results))
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
    row = {"ranks": size, "processes": processes, "timeline": timeline(out, size)}
    for phase in phases(repeats) + [f"creation {i} and lookups" for i in range(1, repeats + 1)]:
        times = [out[(r, phase)][0] for r in range(size)]
        ops = [out[(r, phase)][1] for r in range(size)]
        row[phase] = {"slowest_s": max(times), "ops_max": max(ops), "ops_min": min(ops),
                      "requests_per_s": sum(ops) / max(times)}
    return row


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5,
                        help="floor, least meeting and creation, in turn, this many times")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--timeline", action="store_true",
                        help="after the table, each size's last creation operation by operation")
    args = parser.parse_args()
    rows = []
    print("| ranks | floor (slowest rank) | least meeting (÷ floor) | creation | ÷ floor | first creation | with the "
          "first collective's 2 lookups | store ops per rank (creation; with lookups) | store requests/s (creation) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.ranks:
        row = simulate(size, args.processes, args.repeats)
        rows.append(row)
        runs = range(1, args.repeats + 1)
        floor_s = _median([row[f"floor {i}"]["slowest_s"] for i in runs])
        least_s = _median([row[f"least meeting {i}"]["slowest_s"] for i in runs])
        created = [row[f"creation {i}"] for i in runs]
        creation_s = _median([c["slowest_s"] for c in created])
        looked = [row[f"creation {i} and lookups"] for i in runs]
        print(f"| {size:,} | {floor_s:.3f} s | {least_s:.3f} s ({least_s / floor_s:.1f}) | {creation_s:.3f} s | "
              f"{creation_s / floor_s:.1f} | "
              f"{created[0]['slowest_s']:.3f} s | {_median([c['slowest_s'] for c in looked]):.3f} s | "
              f"{min(c['ops_min'] for c in created)}-{max(c['ops_max'] for c in created)}; "
              f"{min(c['ops_min'] for c in looked)}-{max(c['ops_max'] for c in looked)} | "
              f"{_median([c['requests_per_s'] for c in created]):,.0f} |", flush=True)
    if args.timeline:
        for row in rows:
            print(f"\n{row['ranks']:,} ranks, the last creation and its lookups:")
            print("\n".join(row["timeline"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
