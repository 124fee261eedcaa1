"""The harness itself: results in rank order, env per pool, and above all: a hanging, raising
or dying rank fails the test within its bound, the pool is SIGKILLed, and the next test gets
a fresh pool that works.  These tests use their own pools (env marker) so that killing them
costs the other tests nothing."""

from __future__ import annotations

import ctypes
import os
import signal
import shutil
import time

import pytest
import torch
import torch.distributed as dist

import harness

pytestmark = pytest.mark.harness
ENV = {"TORUS_TEST_HARNESS_SELFTEST": "1"}
WS = 2


def _echo(ctx, x, t, *, k=None):
    return (ctx.rank, ctx.world_size, x, t * (ctx.rank + 1), k, os.environ.get(
        "TORUS_TEST_HARNESS_SELFTEST"), dist.get_backend())


def _sum_ranks(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return t.item()


def _sleep_forever_on(ctx, rank):
    if ctx.rank == rank:
        time.sleep(3600)
    return "ok"


def _barrier_on(ctx, rank):
    if ctx.rank == rank:
        dist.barrier()  # the others never join: a collective hang
    return "ok"


def _raise_on_and_hang_others(ctx, rank):
    if ctx.rank == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    time.sleep(3600)


def _die_on(ctx, rank):
    if ctx.rank == rank:
        print("about to die", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)


def _segfault_on(ctx, rank):
    if ctx.rank == rank:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    time.sleep(3600)


def _unpicklable(ctx):
    return lambda: None


def _pids(ctx):
    return os.getpid()


def _fresh_pool_works(backend, old_pool):
    pool = harness.get_pool(backend, WS, env=ENV)
    assert pool is not old_pool and pool.alive
    assert harness.run(backend, WS, _sum_ranks, env=ENV) == [float(sum(range(WS)))] * WS


def _assert_pool_killed(pool):
    assert not pool.alive
    for p in pool.procs:
        assert p.exitcode is not None, f"worker {p.pid} still running after the kill"


def test_results_in_rank_order_and_env(backend):
    out = harness.run(backend, WS, _echo, "x", torch.arange(3), k=5, env=ENV)
    assert [o[0] for o in out] == list(range(WS))
    for r, o in enumerate(out):
        assert o[1] == WS and o[2] == "x" and o[4] == 5 and o[5] == "1"
        assert torch.equal(o[3], torch.arange(3) * (r + 1))
        assert harness.split_backend(backend)[0] in str(o[6])
    # a pool without the env does not see it
    assert harness.run(backend, 1, _echo, 0, torch.zeros(1))[0][5] is None


def test_hanging_rank_fails_within_bound_and_next_case_gets_fresh_pool(backend):
    pool = harness.get_pool(backend, WS, env=ENV)
    t0 = time.monotonic()
    with pytest.raises(harness.CaseFailure) as info:
        harness.run(backend, WS, _sleep_forever_on, 1, env=ENV, timeout=3)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert 3 <= elapsed < 3 + 30, elapsed  # the bound, plus the stacks (gdb's at most 15 s) and kill
    assert "HUNG" in msg and "rank(s) [1]" in msg and "answered: rank(s) [0]" in msg
    assert "_sleep_forever_on" in msg  # the faulthandler stack of the hung rank
    assert "--- rank 1: native stacks (gdb):" in msg
    if shutil.which("gdb"):
        native = msg.split("--- rank 1: native stacks (gdb):")[1]
        assert "Thread " in native and "#0 " in native, native  # every thread's frames, innermost first
    _assert_pool_killed(pool)
    _fresh_pool_works(backend, pool)


def test_collective_hang_names_the_hung_rank(backend):
    pool = harness.get_pool(backend, WS, env=ENV)
    t0 = time.monotonic()
    with pytest.raises(harness.CaseFailure) as info:
        harness.run(backend, WS, _barrier_on, 0, env=ENV, timeout=3)
    assert time.monotonic() - t0 < 3 + 30
    assert "HUNG" in str(info.value) and "rank(s) [0]" in str(info.value)
    assert "barrier" in str(info.value)
    _assert_pool_killed(pool)
    _fresh_pool_works(backend, pool)


def test_failing_rank_fails_fast(backend):
    pool = harness.get_pool(backend, WS, env=ENV)
    t0 = time.monotonic()
    with pytest.raises(harness.CaseFailure) as info:
        harness.run(backend, WS, _raise_on_and_hang_others, 0, env=ENV, timeout=120, grace=1)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 1 + 35, f"waited {elapsed:.1f}s: should not wait for the 120s bound"
    assert "deliberate failure on rank 0" in msg and "ValueError" in msg
    assert "raised on rank(s) [0]" in msg and "HUNG" in msg
    _assert_pool_killed(pool)
    _fresh_pool_works(backend, pool)


def test_dying_rank_is_reported(backend):
    pool = harness.get_pool(backend, WS, env=ENV)
    t0 = time.monotonic()
    with pytest.raises(harness.CaseFailure) as info:
        harness.run(backend, WS, _die_on, 1, env=ENV, timeout=120, grace=1)
    assert time.monotonic() - t0 < 1 + 35
    msg = str(info.value)
    assert "DIED (killed by SIGKILL)" in msg and "about to die" in msg
    _assert_pool_killed(pool)
    _fresh_pool_works(backend, pool)


def test_crashing_rank_shows_native_and_python_stacks(backend):
    with pytest.raises(harness.CaseFailure) as info:
        harness.run(backend, WS, _segfault_on, 1, env=ENV, timeout=120, grace=1)
    died = str(info.value).split("--- rank 1: DIED (killed by SIGSEGV); its output:")[1]
    assert "SIGSEGV(11), PID:" in died and "frame #" in died, died  # every thread's native stack
    assert "_segfault_on" in died, died  # faulthandler's Python frames, after them


def test_unpicklable_result_and_bad_case_reference(backend):
    with pytest.raises(harness.CaseFailure, match="not picklable"):
        harness.run(backend, WS, _unpicklable, env=ENV)
    with pytest.raises(TypeError, match="module-level"):
        harness.run(backend, WS, lambda ctx: None, env=ENV)
    _fresh_pool_works(backend, None)


def test_pool_is_reused_between_cases(backend):
    a = harness.run(backend, WS, _pids, env=ENV)
    b = harness.run(backend, WS, _pids, env=ENV)
    assert a == b and len(set(a)) == WS


def test_one_off_job_leaves_no_process(backend):
    out = harness.run_job(backend, WS, _echo, 1, torch.ones(1), init="file", timeout=60)
    assert [o[0] for o in out] == list(range(WS))
    pids = harness.run_job(backend, WS, _pids, init="none", timeout=60)
    for pid in pids:
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"one-off worker {pid} still alive")
