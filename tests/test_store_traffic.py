"""Group creation's store traffic: what a real 8-rank creation issues, counted by a store that
wraps the job's TCPStore, is what benchmarks/creation_at_scale.py's simulation issues, operation
for operation on every rank; and the busiest rank's count, with one all_reduce, is small and
independent of how long the ranks took to arrive."""

from __future__ import annotations

import datetime
import os
import re
import sys
import threading

import torch.distributed as dist

import harness

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from creation_at_scale import CountingStore, create  # noqa: E402

RANKS = 8


def _torus_ops(ops: list[tuple[str, str]]) -> list[str]:
    """The operations on torus's keys, their numbers and epochs written as '#' (c10d's own
    prefixes and keys dropped)."""
    out = []
    for op, keys in ops:
        if "torus/" in keys:  # a wait for several keys lists them all
            keys = ",".join(key[key.index("torus/"):] for key in keys.split(","))
        elif not keys.endswith(" keys"):
            continue
        out.append(f"{op} {re.sub(r'[0-9]+(-[0-9a-f]+)?', '#', keys)}")
    return out


def _case_real_creation(ctx):
    import torch
    import torch_torus  # noqa: F401 (registers the backend)

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", ctx.rdv["port"], ctx.world_size, is_master=ctx.rank == 0,
                          timeout=timeout, wait_for_workers=True)
    counting = CountingStore(store)
    dist.init_process_group("torus", store=counting, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
    created = list(counting.ops)
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.barrier()
    total = len(counting.ops)
    dist.destroy_process_group()
    return {"creation": _torus_ops(created), "torch_ops": len(created) - len(_torus_ops(created)),
            "with_all_reduce": total, "sum": t[0].item()}


class _Ordered(CountingStore):
    """A simulated rank's store that tells `arrived` once it has read (or, rank 0, added to) the
    counter of generations."""

    def __init__(self, store, arrived: threading.Semaphore):
        super().__init__(store)
        self.arrived = arrived

    def add(self, key, amount):
        value = super().add(key, amount)
        if key.endswith("torus/epoch/generations"):
            self.arrived.release()
        return value


def _simulated(rank0_first: bool) -> list[list[str]]:
    """Each simulated rank's torus operations in an 8-rank creation where rank 0 arrives before
    every other rank, or after all of them."""
    from torch_torus.config import resolve

    values = resolve()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    arrived = threading.Semaphore(0)
    stores = [_Ordered(dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=60)), arrived) for _ in range(RANKS)]
    errors = []

    def rank_main(rank):
        try:
            if rank0_first != (rank == 0):
                for _ in range(1 if rank0_first else RANKS - 1):
                    assert arrived.acquire(timeout=60), "the other ranks did not arrive"
            create(stores[rank], rank, RANKS, values, timeout=60)
        except Exception as error:
            errors.append(f"rank {rank}: {error!r}")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not errors and not any(t.is_alive() for t in threads), errors or "a simulated rank hung"
    return [_torus_ops(s.ops) for s in stores]


def test_simulation_issues_the_operations_of_a_real_creation():
    results = harness.run_job("torus", RANKS, _case_real_creation, env={"TORUS_TRANSPORT": "tcp"}, timeout=120)
    assert all(r["sum"] == RANKS for r in results), [r["sum"] for r in results]
    simulated = _simulated(rank0_first=True) + _simulated(rank0_first=False)
    rank0_paths = {tuple(simulated[0]), tuple(simulated[RANKS])}
    other_paths = {tuple(ops) for i, ops in enumerate(simulated) if i % RANKS != 0}
    assert len(rank0_paths) == 1, rank0_paths
    for rank, result in enumerate(results):
        paths = rank0_paths if rank == 0 else other_paths
        assert tuple(result["creation"]) in paths, (
            f"rank {rank}'s real creation issued operations the simulation does not:\n"
            + "\n".join(result["creation"]) + "\nsimulated:\n" + "\n\n".join("\n".join(p) for p in paths))
    counts = [len(r["creation"]) for r in results]
    busiest = max(r["with_all_reduce"] for r in results)
    print(f"torus's store operations per rank in creation: {counts}; busiest rank with one all_reduce and "
          f"a barrier, torch's own included: {busiest}")
    assert busiest <= 60, busiest


def _agree(store_port: int, size: int, skip: frozenset = frozenset()) -> list:
    """The ranks' meeting (topology.agree) on every rank of a `size`-rank group but those in
    `skip`, each a thread with its own client; the epochs (or errors) by rank."""
    from torch_torus.topology import agree

    epochs: list = [None] * size

    def rank_main(rank):
        client = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=30))
        try:
            epochs[rank] = agree(client, rank, size, "{}", lambda records, details, epoch: {}, 3 if skip else 30)["epoch"]
        except TimeoutError as error:
            epochs[rank] = error

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size) if r not in skip]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "the meeting hung"
    return epochs


def test_no_epoch_is_taken_from_an_earlier_group():
    """Attempts that died at every point of the agreement, and a group that completed, leave keys
    behind; every later group agrees on an epoch of its own, and a group missing a rank fails
    naming it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    size, seen = 4, set()

    def fresh_group(skip=frozenset()):
        epochs = _agree(server.port, size, skip)
        if skip:
            return epochs
        assert len(set(epochs)) == 1 and isinstance(epochs[0], str), epochs
        assert epochs[0] not in seen, f"epoch {epochs[0]} taken again"
        seen.add(epochs[0])

    fresh_group()  # completes generation 1
    fresh_group()  # a re-creation: its early ranks find generation 1 full
    failed = fresh_group(skip=frozenset({2}))  # rank 2 never comes: the others time out, naming it
    assert "[2]" in str(failed[0]) and all(isinstance(e, TimeoutError) for r, e in enumerate(failed) if r != 2), failed
    # An attempt killed after two ranks joined a generation whose rank 0 then died.
    from torch_torus.topology import RANK0_ARRIVAL

    generation = server.add("torus/epoch/generations", RANK0_ARRIVAL) // RANK0_ARRIVAL
    for rank in (1, 3):
        server.set(f"torus/epoch/{generation}/rank/{rank}", "dead\n{}")
    fresh_group()
    # A rank 0 killed as it arrived, before any rank joined it: the next group's ranks that read
    # its generation claim their places there, until the next rank 0 supersedes it.
    server.add("torus/epoch/generations", RANK0_ARRIVAL)
    fresh_group()


def _busiest_on_one_host(ranks: int) -> tuple[int, list[str]]:
    """The most store operations any rank issues (torch's own included) to create a group of
    `ranks` ranks on one host over shared memory and run one all_reduce; and that rank's
    operations."""
    results = harness.run_job("torus", ranks, _case_real_creation, env={"TORUS_TRANSPORT": "shm"},
                              timeout=60 + 10 * ranks)
    assert all(r["sum"] == ranks for r in results), [r["sum"] for r in results]
    busiest = max(results, key=lambda r: r["with_all_reduce"])
    return busiest["with_all_reduce"], busiest["creation"]


def test_store_operations_stay_constant_with_the_ranks_of_a_host():
    """A rank reads every peer of its host's shared-memory segment in one batched store operation
    (and their readiness in one more): the busiest rank's store operations for creation and one
    all_reduce at 4 times the ranks are within 8 of those at a quarter. (Measured by hand: 8 ranks
    against 32, the bound the issue set.)"""
    few, few_ops = _busiest_on_one_host(4)
    many, many_ops = _busiest_on_one_host(16)
    print(f"busiest rank's store operations, creation and one all_reduce on one host over shm: "
          f"{few} at 4 ranks, {many} at 16")
    assert many - few <= 8, (few, many, few_ops, many_ops)
