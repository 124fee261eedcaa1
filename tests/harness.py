"""Multi-process test harness for torch.distributed backends.

A *pool* is N persistent worker processes (multiprocessing "spawn" context), one per rank.
Each worker initialises the default process group ONCE with the backend under test (no gloo
bootstrap group: the default group *is* the backend under test), then serves *cases*.

A *case* is a module-level function ``case(ctx, *args, **kwargs)``.  It is sent to the workers
by reference (module name + qualified name; plus the file path as a fallback) together with
picklable arguments; every rank runs it and returns a picklable result or a traceback.
``ctx`` is a :class:`WorkerContext` (rank, world_size, backend, env, scratch dir, helpers).

Bounds: every case has a bound (``timeout``, default ``TORUS_TEST_TIMEOUT`` = 60 s).  Results
are collected as they arrive.  When a rank raises or dies, the others get only a short grace
(``TORUS_TEST_GRACE`` = 5 s) to answer.  On any failure (exception, death, hang) the hung
workers' Python stacks are dumped (faulthandler on SIGUSR1) and their native ones read (gdb,
where installed), the whole pool is SIGKILLed
(each worker leads its own process group, killed with killpg), the test fails with every
rank's traceback / log / stack, and the next test gets a fresh pool.

Typical use from a test::

    def _case_sum(ctx, n):                       # runs on every rank
        t = torch.full((n,), float(ctx.rank))
        dist.all_reduce(t)
        return t.tolist()

    def test_sum(backend):
        results = harness.run(backend, 4, _case_sum, 3)    # list, one entry per rank
        assert results[0] == [6.0] * 3

    # cases that return a list of problem strings ([] = pass) can use check():
    harness.check(backend, 4, _case_returning_problems, args..., gap=...)

Pools are cached per (backend, world_size, env, init, options) for the whole session
(created lazily, LRU-evicted above ``TORUS_TEST_MAX_WORKERS`` live workers, torn down at
session end by conftest.py).  :func:`run_job` runs one case on a fresh, throw-away set of
processes (for init_method variants, destroy/re-init, ...).

This module must not import torch at import time: workers apply their env first.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from harness_pools import STATS, Pool, _POOLS, discard_pool, get_pool, run, run_job, shutdown_all
from harness_processes import (DEFAULT_GRACE, DEFAULT_TIMEOUT, MAX_WORKERS, PG_TIMEOUT, STARTUP_TIMEOUT,
                               CaseFailure, PoolSpec, StartupFailure, WorkerContext, free_port, make_spec,
                               split_backend, without_ofi)

__all__ = ["CaseFailure", "DEFAULT_GRACE", "DEFAULT_TIMEOUT", "MAX_WORKERS", "PG_TIMEOUT", "Pool", "PoolSpec",
           "STARTUP_TIMEOUT", "STATS", "StartupFailure", "WorkerContext", "check", "conclude", "discard_pool",
           "free_port", "get_pool", "make_spec", "problems", "run", "run_job", "shutdown_all", "split_backend",
           "without_ofi", "_POOLS"]


# --------------------------------------------------------------------------------------
# assertions


def problems(results: Sequence[Any]) -> List[str]:
    """Flatten per-rank lists of problem strings into 'rank r: ...' lines."""
    out = []
    for r, res in enumerate(results):
        if res is None:
            continue
        if isinstance(res, str):
            res = [res]
        for p in res:
            out.append(f"rank {r}: {p}")
    return out


def check(backend: str, world_size: int, fn: Callable, *args, gap=None, **kwargs) -> None:
    """Run a case whose ranks return lists of problem strings; [] everywhere = pass.

    ``gap``: an expectations.Gap when the backend is known (table in expectations.py) not to
    meet the contract here: the case must then fail the way the table says (-> xfail), and
    passing is an error (the table is stale)."""
    __tracebackhide__ = True
    results = run(backend, world_size, fn, *args, **kwargs)
    conclude(problems(results), gap, f"{backend} world_size={world_size}")


def conclude(found: List[str], gap=None, where: str = "") -> None:
    __tracebackhide__ = True
    import pytest

    text = "\n".join(found)
    if len(text) > 20000:
        text = text[:20000] + f"\n[... {len(found)} problems in all]"
    if gap is None:
        if found:
            pytest.fail(f"{len(found)} problem(s) [{where}]:\n{text}", pytrace=False)
        return
    if not found:
        pytest.fail(f"expectation table says: {gap}\nbut the case PASSED [{where}]: "
                    "remove or narrow the entry in tests/expectations.py", pytrace=False)
    if not gap.explains(found):
        pytest.fail(f"known gap: {gap}\nbut the case failed differently [{where}]:\n{text}",
                    pytrace=False)
    pytest.xfail(f"{gap} (confirmed: {found[0][:200]})")
