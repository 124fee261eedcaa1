"""The memory's bound on one host: what the host's memory moves when every core copies at once,
and the least time a collective can take through it.

A collective of S bytes on n ranks of one host must read each input byte and write each output
byte at least once (Collective.memory_bytes: 2·n·S for an in-place allreduce). At the host's
memory bandwidth B (bytes read plus bytes written per second, all cores together) that takes
memory_bytes / B; the bench's %mem column is that bound as a share of the measured time.

B is timed by as many ranks as can run at once (one per core, at most one per rank), each
copying its own buffer with one thread, all started together: more processes than cores would
time-slice, and one process alone cannot draw what the memory gives all cores. They copy twice:
with plain stores (torch's copy_), and with stores that bypass the caches (_C.streaming_copy). A
plain store first reads the line it writes, a third pass over memory that the bytes counted leave
out: on the 2-core machine of BENCHMARKS.md two processes copying 64 MiB moved 26 GB/s with plain
stores and 48 GB/s with streaming ones. A bound must be the most the memory moves, so B is the
faster of the two; the plain figure stays in the JSON for the cost model, which was fitted to it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import torch
import torch.distributed as dist

from .sizes import human_size

# Far above any last-level cache, so that the copies go to memory.
HOST_COPY_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """The host's memory bandwidth as `processes` ranks copying at once measured it."""

    nbytes: int  # each process's buffer
    processes: int
    rounds: int
    copies: int  # per process and round
    # 1e9 bytes read + written per second, all processes together...
    plain_gbps: float  # ...copying with plain stores
    streaming_gbps: float  # ...copying with stores that bypass the caches

    @property
    def gbps(self) -> float:
        """The bound's bandwidth: the faster way."""
        return max(self.plain_gbps, self.streaming_gbps)

    def bound_seconds(self, memory_bytes: int) -> float:
        return memory_bytes / (self.gbps * 1e9)

    def describe(self) -> str:
        return (f"{self.gbps:.1f} GB/s, bytes read + written per second by {self.processes} rank"
                f"{'s' if self.processes > 1 else ''} at once, each copying {human_size(self.nbytes)}iB with one "
                f"thread, best of {self.rounds} rounds of {self.copies} copies (streaming stores "
                f"{self.streaming_gbps:.1f}, plain stores {self.plain_gbps:.1f}: the faster counts)")

    def to_json(self) -> dict:
        return {"gbps": self.gbps, "plain_gbps": self.plain_gbps, "streaming_gbps": self.streaming_gbps,
                "bytes_per_process": self.nbytes, "processes": self.processes, "rounds": self.rounds,
                "copies_per_round": self.copies}


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a launcher or cgroup set it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_memory_bandwidth(bootstrap: dist.ProcessGroup, nbytes: int = HOST_COPY_BYTES, rounds: int = 10,
                          copies: int = 4) -> HostMemory:
    """Every rank of `bootstrap` (all on one host) calls this; ranks below min(cores, ranks)
    copy, the others only wait. Each round starts after a barrier; its time is the slowest
    copier's, and the best round counts, for each way of copying. Every rank gets the same
    figures."""
    from torch_torus import _C

    rank, world_size = dist.get_rank(bootstrap), dist.get_world_size(bootstrap)
    processes = max(1, min(usable_cores(), world_size))
    copier = rank < processes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per process: the processes, not the threads, fill the cores
    try:
        if copier:
            source = torch.ones(nbytes, dtype=torch.uint8)
            target = torch.empty_like(source)
            target.copy_(source)  # touched: no page faults in the timed copies
        ways = {"plain": lambda: target.copy_(source), "streaming": lambda: _C.streaming_copy(target, source)}
        gbps = {}
        for way, copy in ways.items():
            best = math.inf
            for _ in range(rounds):
                dist.barrier(group=bootstrap)
                start = time.perf_counter()
                if copier:
                    for _ in range(copies):
                        copy()
                slowest = torch.tensor([time.perf_counter() - start if copier else 0.0], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=bootstrap)
                best = min(best, slowest.item())
            gbps[way] = processes * copies * 2 * nbytes / best / 1e9
    finally:
        torch.set_num_threads(threads)
    return HostMemory(nbytes=nbytes, processes=processes, rounds=rounds, copies=copies, plain_gbps=gbps["plain"],
                      streaming_gbps=gbps["streaming"])
