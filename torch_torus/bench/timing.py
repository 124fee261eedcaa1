"""Timing in rounds, for the bench and the tuner alike.

At one size every contender is timed in turn, for several rounds in a new order each, so that
drift of a shared machine hits every contender alike. The first round makes --iters calls; with
--min-round-ms the later rounds make as many as last that long, so that small sizes, where one
call is a few scheduling delays, average over more calls. Calls are timed in one of two ways
(--timing):

loop  the calls back to back, each waited for before the next, as nccl-tests does. A round's time
      is the mean per call on the slowest rank; a contender's time is its best round's, since
      other work on the machine only ever adds time.
osu   each call after a barrier of the contender's own (MPI_Barrier on its communicator, as
      OSU's osu_allreduce does), and timed alone: the situation of a training step, whose ranks
      come to a collective from compute and not from the previous collective, skewed by the
      barrier's exit. A call's time is the slowest rank's; a contender's time is the median over
      its calls of every round (a best round would keep the luckiest calls). OSU's latency columns
      come with it: each rank's mean per call, averaged, least and most over ranks. Where every
      rank reads one clock (one host), two more say where a call's time goes: the barrier's exit
      skew (the last rank's start less the first's) and the time from the last rank's start to
      the last rank's end (the collective once everyone is in it).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

# The buffer the GPU's copy bandwidth is measured with: large enough that the copy streams from
# and to device memory (past any L2) and that launch overhead does not count.
DEVICE_COPY_BYTES = 256 << 20

# --timing's choices, as the bench's and the tuner's headers describe them.
TIMINGS = {
    "loop": "calls back to back, each waited for before the next (nccl-tests)",
    "osu": "a barrier of the contender's own before each call, each call timed alone (OSU's osu_allreduce)",
}


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    iters: int  # timed calls per round: every round's, or the first one's with min_round_ms
    warmup: int  # untimed calls before each round's timed ones
    rounds: int
    min_round_ms: float  # after the first round, calls enough to last this long; 0: off
    timing: str = "loop"  # one of TIMINGS

    @classmethod
    def of(cls, args) -> RoundPlan:
        """The plan that a command line's --iters, --warmup, --rounds, --min-round-ms and --timing give."""
        return cls(args.iters, args.warmup, args.rounds, args.min_round_ms, args.timing)


@dataclasses.dataclass(frozen=True)
class RankLatency:
    """OSU's latency columns: each rank's mean seconds per call, averaged, least and most over ranks."""

    avg: float
    min: float
    max: float


@dataclasses.dataclass(frozen=True)
class CallBreakdown:
    """Where an osu call's time goes, medians over calls, in seconds."""

    exit_skew: float  # the last rank's start less the first's: how far apart the barrier let them go
    after_last: float  # the last rank's start to the last rank's end: the collective once all are in


@dataclasses.dataclass(frozen=True)
class Measured:
    """One contender's time per call, the same on every rank."""

    seconds: float  # loop: the best round's mean on the slowest rank; osu: the median call's, slowest rank
    latency: RankLatency | None = None  # osu only
    breakdown: CallBreakdown | None = None  # osu on one clock only


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


def time_each_call(call: Callable[[], None], calls: int, warmup: int, barrier: Callable[[], None],
                   synchronize: Callable[[], None]) -> list[tuple[float, float]]:
    """Start and end (time.perf_counter) of each of `calls` calls on this rank, after `warmup`
    untimed calls; each call starts after `barrier`, so that its ranks arrive as they leave the
    barrier and not as they left the previous call, and is waited for before its clock stops."""
    for _ in range(warmup):
        call()
    synchronize()
    spans = []
    for _ in range(calls):
        barrier()
        start = time.perf_counter()
        call()
        synchronize()
        spans.append((start, time.perf_counter()))
    return spans


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


def timed_rounds(calls: Sequence[Callable[[], None]], plan: RoundPlan, bootstrap: dist.ProcessGroup,
                 time_round: Callable[..., list[float]], synchronize: Callable[[], None],
                 reset: Callable[[], None], timed: Callable[[int], None]) -> list[list[list[float]]]:
    """This rank's seconds, [round][contender] -> what `time_round(index, calls, warmup, bootstrap,
    synchronize)` returned for that contender's round (one mean per round, or one figure per
    call). `reset` runs before each contender's round, `timed(index)` after it."""
    seconds: list[list[list[float]]] = [[[] for _ in calls] for _ in range(plan.rounds)]
    round_calls = [plan.iters] * len(calls)
    for round_index in range(plan.rounds):
        for index in round_order(len(calls), round_index):
            reset()
            seconds[round_index][index] = time_round(index, round_calls[index], plan.warmup, bootstrap, synchronize)
            timed(index)
        if round_index == 0 and plan.rounds > 1 and plan.min_round_ms > 0:
            first = torch.tensor([statistics.fmean(figures) for figures in seconds[0]], dtype=torch.float64)
            dist.all_reduce(first, op=dist.ReduceOp.MAX, group=bootstrap)
            round_calls = calls_per_round(first.tolist(), plan.iters, plan.min_round_ms)
    return seconds


def best_round_seconds(calls: Sequence[Callable[[], None]], plan: RoundPlan, bootstrap: dist.ProcessGroup,
                       synchronize: Callable[[], None] = _nothing, reset: Callable[[], None] = _nothing,
                       timed: Callable[[int], None] = _nothing) -> list[float]:
    """Seconds per call of each of `calls` (one per contender) timed back to back, the same on
    every rank of `bootstrap`: its best round's, each round the slowest rank's mean. `synchronize`
    waits for the device after each call; `reset` runs before each contender's round (so that
    each starts from the same data); `timed(index)` after it."""
    # time_calls looked up at each call, where a test replaces it.
    seconds = timed_rounds(calls, plan, bootstrap,
                           lambda index, *round_arguments: [time_calls(calls[index], *round_arguments)],
                           synchronize, reset, timed)
    per_round = torch.tensor([[mean for [mean] in contenders] for contenders in seconds], dtype=torch.float64)
    dist.all_reduce(per_round, op=dist.ReduceOp.MAX, group=bootstrap)
    return per_round.min(dim=0).values.tolist()


def measured_from_calls(starts: torch.Tensor, ends: torch.Tensor, one_clock: bool = False) -> Measured:
    """One contender's figures from every rank's start and end of each call, [ranks, calls]
    (time.perf_counter), call i of every rank after the same barrier: the median over calls of
    the slowest rank's time of that call, OSU's latency columns over the ranks' means, and, where
    the ranks' clocks are one (`one_clock`: one host), the call's breakdown."""
    seconds = ends - starts
    rank_means = seconds.mean(dim=1)
    breakdown = None
    if one_clock:
        last_start = starts.max(dim=0).values
        breakdown = CallBreakdown(
            exit_skew=statistics.median((last_start - starts.min(dim=0).values).tolist()),
            after_last=statistics.median((ends.max(dim=0).values - last_start).tolist()))
    return Measured(seconds=statistics.median(seconds.max(dim=0).values.tolist()),
                    latency=RankLatency(avg=rank_means.mean().item(), min=rank_means.min().item(),
                                        max=rank_means.max().item()),
                    breakdown=breakdown)


def gather_calls(per_contender: list[list[tuple[float, float]]],
                 bootstrap: dist.ProcessGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's starts and ends of each call, two [ranks, calls] tensors per contender, from
    this rank's: every rank makes as many calls of a contender as the others."""
    mine = torch.tensor([value for spans in per_contender for span in spans for value in span], dtype=torch.float64)
    ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size(bootstrap))]
    dist.all_gather(ranks, mine, group=bootstrap)
    spans = torch.stack(ranks).view(len(ranks), -1, 2)
    return [(part[:, :, 0], part[:, :, 1]) for part in spans.split([len(calls) for calls in per_contender], dim=1)]


def osu_measurements(calls: Sequence[Callable[[], None]], plan: RoundPlan, bootstrap: dist.ProcessGroup,
                     synchronize: Callable[[], None] = _nothing, reset: Callable[[], None] = _nothing,
                     timed: Callable[[int], None] = _nothing,
                     barriers: Sequence[Callable[[], None]] | None = None, one_clock: bool = False) -> list[Measured]:
    """Each of `calls` timed call by call after its barrier (time_each_call) in every round, the
    same on every rank of `bootstrap`: measured_from_calls over its calls of all rounds together.
    `barriers`: each contender's own, by default one on `bootstrap`; `one_clock`: every rank on
    this host, so that their perf_counter clocks (CLOCK_MONOTONIC) are one."""
    if barriers is None:
        barriers = [lambda: dist.barrier(group=bootstrap)] * len(calls)
    # time_each_call looked up at each call, where a test replaces it.
    seconds = timed_rounds(calls, plan, bootstrap,
                           lambda index, count, warmup, _, synchronize: time_each_call(
                               calls[index], count, warmup, barriers[index], synchronize),
                           synchronize, reset, timed)
    per_contender = [[span for contenders in seconds for span in contenders[index]] for index in range(len(calls))]
    return [measured_from_calls(starts, ends, one_clock) for starts, ends in gather_calls(per_contender, bootstrap)]


def time_contenders(calls: Sequence[Callable[[], None]], plan: RoundPlan, bootstrap: dist.ProcessGroup,
                    synchronize: Callable[[], None] = _nothing, reset: Callable[[], None] = _nothing,
                    timed: Callable[[int], None] = _nothing,
                    barriers: Sequence[Callable[[], None]] | None = None, one_clock: bool = False) -> list[Measured]:
    """Each contender's time per call as plan.timing measures it (best_round_seconds or
    osu_measurements, which say what the arguments do)."""
    if plan.timing == "osu":
        return osu_measurements(calls, plan, bootstrap, synchronize, reset, timed, barriers, one_clock)
    return [Measured(seconds) for seconds in best_round_seconds(calls, plan, bootstrap, synchronize, reset, timed)]


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
