"""Collectives issued from a future's callback take their place when they are issued (issue 39).

The scenario that mixed data: rank 0 waits for collective a before attaching a callback to it, so
the callback runs at once, on its own thread, inside then(); the other ranks attach it while a
runs, so it runs when a completes. b, issued before then() on every rank, has the shape of the
callback's c. Every rank must pair b with b and c with c, trial after trial, over every transport.

A callback's collective goes where the callback was attached, before what the caller issues
after then(), however late the callback runs. Where that place cannot be kept (a callback of a
future the program completes itself, run after the caller's next collective started), each
call's signature says where it was issued, so the ranks fail with a mismatch naming both sides
rather than mix their data. And a group destroyed while its worker is inside a callback that
waits for a collective queued behind it returns, failing that collective with an error that says
so.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

import harness

# Every transport keeps these promises: they also run over OFI (conftest.py).
TRANSPORT_CONTRACT = True

TRIALS = 100
NUMEL = 1024


def _case_late_callback(ctx, trials):
    n = ctx.world_size
    problems = []
    for trial in range(trials):
        a = torch.ones(NUMEL)
        first = dist.all_reduce(a, async_op=True)
        if ctx.rank == 0:
            first.wait()  # its callback then runs inside then(), on this thread
        b = torch.full((NUMEL,), 10.0)
        second = dist.all_reduce(b, async_op=True)
        c = torch.full((NUMEL,), 100.0)
        chained = first.get_future().then(lambda _: dist.all_reduce(c))
        second.wait()
        chained.wait()
        for name, tensor, want in (("a", a, 1.0 * n), ("b", b, 10.0 * n), ("c", c, 100.0 * n)):
            if not torch.equal(tensor, torch.full((NUMEL,), want)):
                problems.append(f"trial {trial}: {name} = {tensor[:2].tolist()}..., want {want}")
        if problems:
            break
    return problems


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"ws{w}")
def test_late_callback_pairs_by_issue_order(backend, world_size):
    if not backend.startswith("torus"):
        pytest.skip("torus's")
    harness.check(backend, world_size, _case_late_callback, TRIALS, timeout=120)


def _case_callback_against_caller(ctx, source):
    """A callback issues c while the caller issues d after attaching it, on rank 0 at once and on
    rank 1 only 0.5 s later. `source` "collective": the callback is attached to a collective's
    future, so c's place is the attach point on both ranks: right sums. "user": attached to a
    future the program completes itself (rank 1 from another thread, late): rank 1 has run d by
    then, so c and d meet at one place and both ranks must raise a mismatch naming the callback's
    call; no tensor may hold a mixed sum."""
    ctx.init_process_group(init="file")
    group = ctx.new_group(timeout=datetime.timedelta(seconds=20))
    problems = []
    c = torch.full((NUMEL,), 100.0)
    d = torch.full((NUMEL,), 1000.0)
    errors = []

    def callback(_):
        if ctx.rank == 1 and source == "collective":
            time.sleep(0.5)
        try:
            dist.all_reduce(c, group=group)
        except RuntimeError as error:
            errors.append(str(error))

    if source == "collective":
        first = dist.all_reduce(torch.ones(NUMEL), group=group, async_op=True)
        if ctx.rank == 0:
            first.wait()
        future = first.get_future()
    else:
        future = torch.futures.Future()
        if ctx.rank == 0:
            future.set_result(None)
        else:
            threading.Timer(0.5, future.set_result, args=(None,)).start()
    chained = future.then(callback)
    try:
        dist.all_reduce(d, group=group)
    except RuntimeError as error:
        errors.append(str(error))
    try:
        chained.wait()
    except RuntimeError as error:
        errors.append(str(error))
    n = ctx.world_size
    if source == "collective":
        for name, tensor, want in (("c", c, 100.0 * n), ("d", d, 1000.0 * n)):
            if not torch.equal(tensor, torch.full((NUMEL,), want)):
                problems.append(f"{name} = {tensor[:2].tolist()}..., want {want}")
        if errors:
            problems.append(f"errors: {errors}")
    else:
        for name, tensor, alone in (("c", c, 100.0), ("d", d, 1000.0)):
            if not (torch.equal(tensor, torch.full((NUMEL,), alone)) or
                    torch.equal(tensor, torch.full((NUMEL,), alone * n))):
                problems.append(f"{name} holds mixed data: {tensor[:2].tolist()}")
        texts = " | ".join(errors)
        if "ranks called different collectives" not in texts or "issued by a future's callback" not in texts:
            problems.append(f"no mismatch naming the callback's collective: {errors or 'no error at all'}")
    dist.destroy_process_group(group)
    return problems


@pytest.mark.parametrize("source", ["collective", "user"])
def test_callback_against_caller(backend, source):
    if not backend.startswith("torus"):
        pytest.skip("torus's")
    harness.conclude(harness.problems(harness.run_job(backend, 2, _case_callback_against_caller, source,
                                                      timeout=90)), None, backend)


def _case_destroy_while_callback_waits(ctx):
    """On rank 0 the callback of a waits for b, queued behind it (a is held back by z, which rank 1
    issues late, so that the callback is attached before a completes and runs on the worker).
    destroy_process_group must return at once on rank 0, and b fail saying the group was
    destroyed; rank 1's b fails as its peer left."""
    ctx.init_process_group(init="file")
    group = ctx.new_group(timeout=datetime.timedelta(seconds=60))
    problems = []
    if ctx.rank == 1:
        time.sleep(0.5)
    held_back = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    first = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    later = {}
    outcome = []
    if ctx.rank == 0:
        issued = threading.Event()

        def wait_for_later(_):
            issued.wait(30)
            try:
                later["work"].wait()
                outcome.append("b completed")
            except RuntimeError as error:
                outcome.append(str(error))

        first.get_future().then(wait_for_later)
    later["work"] = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    if ctx.rank == 0:
        issued.set()
        held_back.wait()
        first.wait()
        time.sleep(0.2)  # the worker is in the callback
    else:
        try:
            later["work"].wait()
            problems.append("b completed on rank 1 without rank 0")
        except RuntimeError:
            pass
    started = time.monotonic()
    dist.destroy_process_group(group)
    took = time.monotonic() - started
    if took > 10:
        problems.append(f"destroy_process_group took {took:.1f} s")
    if ctx.rank == 0 and (not outcome or "destroyed" not in outcome[0]):
        problems.append(f"the queued all_reduce did not fail saying the group was destroyed: {outcome}")
    return problems


def test_destroy_while_a_callback_waits_for_a_queued_collective(backend):
    if not backend.startswith("torus"):
        pytest.skip("torus's")
    harness.conclude(harness.problems(harness.run_job(backend, 2, _case_destroy_while_callback_waits, timeout=90)),
                     None, backend)
