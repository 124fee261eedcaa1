"""Timing in rounds, for the bench and the tuner alike.

At one size every contender is timed in turn, for several rounds in a new order each, so that
drift of a shared machine hits every contender alike. A round's time is the mean per call on the
slowest rank, as in nccl-tests; a contender's time is its best round's, since other work on the
machine only ever adds time. The first round makes --iters calls; with --min-round-ms the later
rounds make as many as last that long, so that small sizes, where one call is a few scheduling
delays, average over more calls.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

# The buffer the GPU's copy bandwidth is measured with: large enough that the copy streams from
# and to device memory (past any L2) and that launch overhead does not count.
DEVICE_COPY_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    iters: int  # timed calls per round: every round's, or the first one's with min_round_ms
    warmup: int  # untimed calls before each round's timed ones
    rounds: int
    min_round_ms: float  # after the first round, calls enough to last this long; 0: off

    @classmethod
    def of(cls, args) -> RoundPlan:
        """The plan that a command line's --iters, --warmup, --rounds and --min-round-ms give."""
        return cls(args.iters, args.warmup, args.rounds, args.min_round_ms)


def time_calls(call: Callable[[], None], calls: int, warmup: int, bootstrap: dist.ProcessGroup,
               synchronize: Callable[[], None]) -> float:
    """Mean seconds per call over `calls` calls on this rank, after `warmup` untimed calls and a
    barrier on `bootstrap`. Every call is waited for before the next one is issued: that is the
    latency a caller sees, and it keeps calls from racing on one buffer."""
    for _ in range(warmup):
        call()
    synchronize()
    dist.barrier(group=bootstrap)
    start = time.perf_counter()
    for _ in range(calls):
        call()
        synchronize()
    return (time.perf_counter() - start) / calls


def round_order(count: int, round_index: int) -> list[int]:
    """The order to time `count` contenders in, in round `round_index`: as listed first, then a new
    order each round, the same on every rank (seeded by the round). What one contender leaves
    behind (gloo's slow small calls on a shaped link, say) then falls on a different one each time."""
    order = list(range(count))
    if round_index:
        random.Random(round_index).shuffle(order)
    return order


def calls_per_round(first_round: list[float], iters: int, min_round_ms: float) -> list[int]:
    """Calls per round for each contender after the first round (its seconds per call there, the
    same on every rank): enough to last `min_round_ms`, up to 100x `iters`. A round of a few small
    calls is mostly the wake-ups after the barrier that starts it; more calls average them out."""
    return [min(100 * iters, max(iters, math.ceil(min_round_ms / 1e3 / max(t, 1e-9)))) for t in first_round]


def _nothing(*_) -> None:
    pass


def best_round_seconds(calls: Sequence[Callable[[], None]], plan: RoundPlan, bootstrap: dist.ProcessGroup,
                       synchronize: Callable[[], None] = _nothing, reset: Callable[[], None] = _nothing,
                       timed: Callable[[int], None] = _nothing) -> list[float]:
    """Seconds per call of each of `calls` (one per contender), the same on every rank of
    `bootstrap`: its best round's, each round the slowest rank's mean. `synchronize` waits for
    the device after each call; `reset` runs before each contender's round (so that each starts
    from the same data); `timed(index)` after it."""
    seconds = [[0.0] * len(calls) for _ in range(plan.rounds)]
    round_calls = [plan.iters] * len(calls)
    for round_index in range(plan.rounds):
        for index in round_order(len(calls), round_index):
            reset()
            seconds[round_index][index] = time_calls(calls[index], round_calls[index], plan.warmup, bootstrap,
                                                     synchronize)
            timed(index)
        if round_index == 0 and plan.rounds > 1 and plan.min_round_ms > 0:
            first = torch.tensor(seconds[0], dtype=torch.float64)
            dist.all_reduce(first, op=dist.ReduceOp.MAX, group=bootstrap)
            round_calls = calls_per_round(first.tolist(), plan.iters, plan.min_round_ms)
    per_round = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(per_round, op=dist.ReduceOp.MAX, group=bootstrap)
    return per_round.min(dim=0).values.tolist()


@dataclasses.dataclass(frozen=True)
class DeviceCopy:
    """A GPU's device-to-device copy bandwidth: the bytes a torch copy_ reads plus the bytes it
    writes, per second. On CUDA the bench reports each busbw as a share of it, the roof of a
    collective whose data stays on the device."""

    gbps: float  # 1e9 bytes per second, read + written
    nbytes: int  # the size of the buffer copied
    device: str  # "cuda:0 (NVIDIA H100 80GB HBM3)"
    rounds: int
    copies: int  # per round, timed together


def device_copy_bandwidth(device: torch.device, nbytes: int = DEVICE_COPY_BYTES, rounds: int = 5,
                          copies: int = 10) -> DeviceCopy:
    """Time `copies` copy_ calls of an nbytes buffer into another on `device` with CUDA events on
    its current stream, `rounds` times after two untimed copies; the best round counts. Each copy
    reads and writes nbytes. The buffers are freed (and the caching allocator's blocks released)
    before returning."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    source.fill_(1)
    target = torch.empty_like(source)
    stream = torch.cuda.current_stream(device)
    for _ in range(2):
        target.copy_(source)
    stream.synchronize()
    best = math.inf
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(copies):
            target.copy_(source)
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / copies)  # elapsed_time is in ms
    del source, target
    torch.cuda.empty_cache()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return DeviceCopy(gbps=2 * nbytes / best / 1e9, nbytes=nbytes,
                      device=f"cuda:{index} ({torch.cuda.get_device_name(index)})",
                      rounds=rounds, copies=copies)
