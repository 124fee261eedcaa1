"""dist.monitored_barrier with torch's semantics (gloo's): rank 0 collects every rank's arrival
within the timeout and raises naming the rank that did not come ("Rank 1 failed to pass
monitoredBarrier in 1000 ms"; every such rank with wait_all_ranks: "Ranks 1, 3 failed ..."); the
ranks that came raise when rank 0 fails ("Rank 2 successfully reached monitoredBarrier, but
received errors while waiting for send/recv from rank 0"); subgroups number their ranks.

A rank that "does not come" waits, bounded, until rank 0 has raised (a file in the scratch
directory says so), so that no case depends on timing. Cases that leave a failed barrier behind
run on fresh processes (harness.run_job).
"""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import expectations
import harness

TIMEOUT = datetime.timedelta(seconds=1)
GROUP_TIMEOUT = datetime.timedelta(seconds=3)  # bounds a rank that waits for rank 0's answer
RANK_0_DONE = "rank0_done"


def _signal_rank_0_done(ctx) -> None:
    open(os.path.join(ctx.scratch, RANK_0_DONE), "w").close()


def _wait_for_rank_0(ctx, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(os.path.join(ctx.scratch, RANK_0_DONE)):
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 did not finish its monitored_barrier")
        time.sleep(0.02)


def _raises(fn, pattern: str, who: str):
    try:
        fn()
    except RuntimeError as error:
        return [] if re.search(pattern, str(error)) else [f"{who}: raised, but not /{pattern}/: {error}"]
    return [f"{who}: returned; expected /{pattern}/"]


def _case_passes(ctx):
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    dist.monitored_barrier()  # the default timeout
    t = torch.ones(3)
    dist.all_reduce(t)  # collectives after it are in step
    return [] if torch.equal(t, torch.full((3,), float(ctx.world_size))) else [f"all_reduce after: {t}"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"ws{w}")
def test_monitored_barrier_passes(backend, world_size):
    harness.check(backend, world_size, _case_passes)


def _case_absent(ctx, absent, wait_all_ranks, late_ranks_call):
    """The ranks in `absent` stay away until rank 0 has raised; with late_ranks_call they call
    then and must raise too (the barrier failed: nobody passes it)."""
    group = ctx.new_group(list(range(ctx.world_size)), timeout=GROUP_TIMEOUT)
    barrier = lambda: dist.monitored_barrier(group, timeout=TIMEOUT, wait_all_ranks=wait_all_ranks)  # noqa: E731
    if ctx.rank == 0:
        if wait_all_ranks:
            expected = rf"Ranks {', '.join(map(str, absent))} failed to pass monitoredBarrier in 1000 ms"
        else:
            expected = rf"Rank {absent[0]} failed to pass monitoredBarrier in 1000 ms"
        problems = _raises(barrier, expected, "rank 0")
        _signal_rank_0_done(ctx)
        return problems
    reached = (rf"Rank {ctx.rank} successfully reached monitoredBarrier, but received errors while waiting for "
               r"send/recv from rank 0")
    if ctx.rank in absent:
        _wait_for_rank_0(ctx)
        return _raises(barrier, reached, f"rank {ctx.rank} (late)") if late_ranks_call else []
    return _raises(barrier, reached, f"rank {ctx.rank}")


@pytest.mark.parametrize("world_size,absent,wait_all_ranks", [
    (2, [1], False), (3, [1], False), (4, [2, 3], False), (2, [1], True), (4, [1, 3], True), (4, [1, 2, 3], True),
], ids=["ws2_1", "ws3_1", "ws4_first_of_2_3", "ws2_1_wait_all", "ws4_1_3_wait_all", "ws4_all_wait_all"])
def test_monitored_barrier_names_absent_ranks(backend, world_size, absent, wait_all_ranks):
    found = harness.problems(harness.run_job(backend, world_size, _case_absent, absent, wait_all_ranks, False,
                                             init="file", timeout=60))
    harness.conclude(found, None, f"{backend} absent {absent}")


def test_monitored_barrier_late_rank_raises_when_it_comes(backend):
    """A rank that arrives after rank 0 gave up raises too: every rank passes, or none does."""
    found = harness.problems(harness.run_job(backend, 3, _case_absent, [1], False, True, init="file", timeout=60))
    harness.conclude(found, expectations.gap(backend, "monitored_barrier.late_rank"), f"{backend} late rank")


def _case_rank_0_absent(ctx):
    """Rank 0 never calls: the others raise (at their group's timeout), naming rank 0."""
    group = ctx.new_group(list(range(ctx.world_size)), timeout=GROUP_TIMEOUT)
    if ctx.rank == 0:
        return []
    pattern = (rf"Rank {ctx.rank} successfully reached monitoredBarrier, but received errors while waiting for "
               r"send/recv from rank 0")
    return _raises(lambda: dist.monitored_barrier(group, timeout=TIMEOUT), pattern, f"rank {ctx.rank}")


def test_monitored_barrier_others_raise_when_rank_0_fails(backend):
    found = harness.problems(harness.run_job(backend, 3, _case_rank_0_absent, init="file", timeout=60))
    harness.conclude(found, None, f"{backend} rank 0 absent")


def _case_rank_0_timeout(ctx):
    group = ctx.new_group(list(range(ctx.world_size)))
    if ctx.rank != 0:
        return []
    return _raises(lambda: group.monitored_barrier(datetime.timedelta(seconds=0)),
                   r"Rank 0 timed out in monitoredBarrier after 0 ms", "rank 0")


def test_monitored_barrier_rank_0_timeout(backend):
    found = harness.problems(harness.run_job(backend, 2, _case_rank_0_timeout, init="file", timeout=60))
    harness.conclude(found, None, f"{backend} rank 0 timeout")


def _case_subgroup(ctx):
    """Subgroup [0, 1] without rank 1: rank 0 names it; rank 2 is no member (a no-op for it).
    Subgroup [1, 2]: group rank 0 is global rank 1, and the barrier passes."""
    passing = ctx.new_group([1, 2])
    failing = ctx.new_group([0, 1])
    problems = []
    if ctx.rank in (1, 2):
        dist.monitored_barrier(passing, timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    if ctx.rank == 0:
        problems += _raises(lambda: dist.monitored_barrier(failing, timeout=TIMEOUT),
                            r"Rank 1 failed to pass monitoredBarrier", "rank 0")
    elif ctx.rank == 2:
        dist.monitored_barrier(failing, timeout=TIMEOUT)
    return problems


def test_monitored_barrier_subgroup(backend):
    found = harness.problems(harness.run_job(backend, 3, _case_subgroup, init="file", timeout=60))
    harness.conclude(found, None, f"{backend} subgroup")
