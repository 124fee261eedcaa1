"""Measuring one size: every contender timed in rounds (timing.py), checked with --check, and
turned into the rows the report prints."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from .collectives import DTYPES, Buffers, CheckPattern, Collective, count_wrong
from .contenders import Contender
from .sizes import size_steps
from .timing import Measured, RoundPlan, time_contenders


@dataclasses.dataclass
class Row:
    """One contender at one size, as reported: times are the slowest rank's."""

    contender: Contender
    size_bytes: int
    count: int
    time_us: float
    algbw: float  # GB/s, 1e9 bytes
    busbw: float
    wrong: int | None  # None when not checked
    algorithm: str | None
    # busbw / the GPU's device-to-device copy bandwidth (--device cuda), else None
    copy_share: float | None = None
    # on one CPU host: the memory's bound (memory_bound.py) as a share of the time, else None
    memory_share: float | None = None
    # --timing osu: each rank's mean per call, averaged, least and most over ranks; else None
    latency_avg_us: float | None = None
    latency_min_us: float | None = None
    latency_max_us: float | None = None
    # --timing osu on one host: the barrier's exit skew, and the call from the last rank's start
    exit_skew_us: float | None = None
    after_last_us: float | None = None

    def to_json(self) -> dict:
        row = {
            "contender": self.contender.label,
            "backend": self.contender.backend,
            "options": self.contender.options,
            "size_bytes": self.size_bytes,
            "count": self.count,
            "time_us": self.time_us,
            "algbw_gbps": self.algbw,
            "busbw_gbps": self.busbw,
            "wrong": self.wrong,
            "algorithm": self.algorithm,
        }
        if self.copy_share is not None:
            row["busbw_share_of_device_copy"] = self.copy_share
        if self.memory_share is not None:
            row["share_of_memory_bound"] = self.memory_share
        if self.latency_avg_us is not None:
            row.update(latency_avg_us=self.latency_avg_us, latency_min_us=self.latency_min_us,
                       latency_max_us=self.latency_max_us)
        if self.exit_skew_us is not None:
            row.update(exit_skew_us=self.exit_skew_us, after_last_us=self.after_last_us)
        return row


def check_contender(collective: Collective, buffers: Buffers, count: int, call: Callable[[], None],
                    pattern: CheckPattern, synchronize: Callable[[], None]) -> int:
    """One call on freshly filled buffers; returns this rank's wrong elements."""
    collective.fill(buffers, pattern)
    call()
    synchronize()
    return count_wrong(buffers.output, collective.expected(count, pattern), collective.world_size)


def measure_size(count: int, collective: Collective, args: argparse.Namespace,
                 pattern: CheckPattern, bootstrap: dist.ProcessGroup,
                 synchronize: Callable[[], None], one_host: bool = False) -> list[Row]:
    contenders = args.contenders
    dtype = DTYPES[args.dtype]
    size_bytes = collective.size_bytes(count, dtype.itemsize)
    buffers = collective.allocate(count, dtype, args.empty)  # shared by all contenders at this size

    calls = [contender.bind(collective, buffers, args.op) for contender in contenders]
    # Each contender starts from the same data: an in-place allreduce repeated grows its values.
    measured = time_contenders(calls, RoundPlan.of(args), bootstrap, synchronize=synchronize,
                               reset=lambda: collective.fill(buffers, pattern),
                               barriers=[contender.barrier for contender in contenders], one_clock=one_host)
    wrong: list[int | None] = [None] * len(calls)
    if args.check:
        wrong_tensor = torch.tensor([check_contender(collective, buffers, count, call, pattern, synchronize)
                                     for call in calls], dtype=torch.int64)
        dist.all_reduce(wrong_tensor, group=bootstrap)  # wrong elements add up over ranks
        wrong = wrong_tensor.tolist()

    copy = getattr(args, "device_copy", None)  # a timing.DeviceCopy on CUDA
    memory = getattr(args, "host_memory", None)  # a memory_bound.HostMemory on one CPU host
    bound = memory.bound_seconds(collective.memory_bytes(size_bytes)) if memory is not None else None
    rows = []
    for index, contender in enumerate(contenders):
        algbw = size_bytes / measured[index].seconds / 1e9
        busbw = algbw * collective.bus_factor()
        rows.append(Row(
            contender=contender, size_bytes=size_bytes, count=count, time_us=measured[index].seconds * 1e6,
            algbw=algbw, busbw=busbw,
            wrong=wrong[index],
            algorithm=contender.algorithm(collective.name, size_bytes),
            copy_share=busbw / copy.gbps if copy is not None else None,
            memory_share=bound / measured[index].seconds if bound is not None else None,
            **latency_fields(measured[index])))
    return rows


def latency_fields(measured: Measured) -> dict[str, float]:
    """A Row's latency_*_us from OSU's columns and its breakdown, none without them (--timing loop)."""
    if measured.latency is None:
        return {}
    fields = {"latency_avg_us": measured.latency.avg * 1e6, "latency_min_us": measured.latency.min * 1e6,
              "latency_max_us": measured.latency.max * 1e6}
    if measured.breakdown is not None:
        fields.update(exit_skew_us=measured.breakdown.exit_skew * 1e6,
                      after_last_us=measured.breakdown.after_last * 1e6)
    return fields


def counts_to_measure(collective: Collective, args: argparse.Namespace) -> list[int]:
    """Element counts for sizes min, min*factor, ... up to max bytes. Small sizes can round to
    the same count (a sharded collective needs a whole element per rank): each is kept once."""
    counts = []
    for size in size_steps(args.min_bytes, args.max_bytes, args.factor):
        count = collective.count_for(size, DTYPES[args.dtype].itemsize)
        if count not in counts:
            counts.append(count)
    return counts
