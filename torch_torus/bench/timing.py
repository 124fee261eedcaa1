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
