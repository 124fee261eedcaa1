"""The device path on every CPU run (issue 28): with TORUS_HOST_DEVICE=on the backend runs
collectives on CPU tensors through the host implementation of its device layer, so that
ProcessGroupTorus -> DeviceSupport -> TorusWork's device branch -> the device collectives
(collectives/device/) -> wait() / get_future() / then() / is_completed() runs here exactly as it
runs for CUDA tensors on a GPU; only the CUDA calls themselves need one.

The cases are tests/cuda_cases.py's, which test_cuda.py runs on a GPU (every collective, sizes
across arena halves, transposed views, DDP, the timeout that names the absent rank), run on CPU
tensors. Routes, as hosts are faked with TORUS_HOST_ID (the group's host identity, which the
arenas honour):
  arenas  every rank on one host: the device collectives go through arenas in POSIX shared memory;
  staged  every rank its own host: staged through host memory over the transport;
  mixed   two hosts of two ranks: a torus grid's rows through arenas, its columns staged.

Then what a stuck device phase does: each phase has a stall bound (TORUS_DEVICE_STALL_TIMEOUT)
whose error names the phase, its round and the rank, played by the host layer's faults
(TORUS_HOST_DEVICE=stall:<step>, fail:enter); a rank that cannot enter a call fails the group so
that its peers do not wait for it; the debug mode reports a wait() that does not return after
its collective completed. With the build of f717c76 the first collective's wait() deadlocks
here (the harness's case bound fails it); see BENCHMARKS.md / the commit for the run."""

from __future__ import annotations

import datetime
import os
import re
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import harness
import cuda_cases
from reference import DTYPE_NAMES, allreduce_contract, compare

BACKEND = "torus"
CASE_TIMEOUT = 90
STALL = "10s"  # the stall bound of the ordinary cases: a stuck phase fails well inside the case bound
ROUTE_SIZES = [("arenas", 2), ("arenas", 4), ("staged", 2), ("staged", 4), ("mixed", 4)]
FLAT_ROUTE_SIZES = [rs for rs in ROUTE_SIZES if rs[0] != "mixed"]


def _on_route(ctx, case, *args):
    """A case of cuda_cases on this rank's host device layer."""
    ctx.state["host device"] = True
    return case(ctx, *args)


def _check(route: str, world_size: int, case, *args, options=None, timeout=CASE_TIMEOUT):
    opts = _route_options(route, world_size, **(options or {}))
    harness.check(BACKEND, world_size, _on_route, case, *args, options=opts, timeout=timeout)


def _route_options(route: str, world_size: int, **more) -> dict:
    options = {"host_device": "on", "transport": "auto", "device_stall_timeout": STALL, **more}
    if route == "arenas":
        options["host_id"] = "one-host"
    elif route == "staged":
        options["host_id"] = "host-{rank}"
    else:  # mixed: two hosts of world_size / 2 ranks; the torus's rows are the hosts
        options["host_id"] = "host-{rank}" if world_size <= 2 else "host-{rank_pair}"
    return options


def _ids(pairs):
    return [f"{route}-ws{ws}" for route, ws in pairs]


# ------------------------------------------------------------------------------ collectives

# Every op on float32; SUM on the other dtypes (the device reduction is the CPU reducer here: the
# kernels' dtypes are tests/test_cuda.py's on a GPU).
ALLREDUCE_CASES = ([("float32", op) for op in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT", "MIN", "MAX")]
                   + [(dtype, "SUM") for dtype in ("float64", "bfloat16", "int64", "uint8")]
                   + [("int32", "BXOR")])


@pytest.mark.parametrize("dtype,op", ALLREDUCE_CASES, ids=[f"{d}-{o}" for d, o in ALLREDUCE_CASES])
@pytest.mark.parametrize("route,world_size", ROUTE_SIZES, ids=_ids(ROUTE_SIZES))
def test_allreduce(route, world_size, dtype, op):
    """all_reduce (sync) at 0 to 1M elements against the one-process reference."""
    assert dtype in DTYPE_NAMES and allreduce_contract(op, dtype) == "ok"
    _check(route, world_size, cuda_cases._case_cuda_allreduce, dtype, op)


@pytest.mark.parametrize("name", list(cuda_cases.CUDA_COLLECTIVES))
@pytest.mark.parametrize("route,world_size", FLAT_ROUTE_SIZES, ids=_ids(FLAT_ROUTE_SIZES))
def test_collective(route, world_size, name):
    """Every other collective, send/recv and barrier, on the device path's staging."""
    _check(route, world_size, cuda_cases._case_cuda_collective, name, "float32")


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast"])
@pytest.mark.parametrize("route,world_size", FLAT_ROUTE_SIZES, ids=_ids(FLAT_ROUTE_SIZES))
def test_sizes_and_transposed(route, world_size, collective):
    """16 MiB (across the arenas' halves and the staging chunks) and a transposed view."""
    _check(route, world_size, cuda_cases._case_cuda_sizes_and_transposed, collective, timeout=180)


# ------------------------------------------------------------------------------ works and futures

FUTURE_COLLECTIVES = ["all_reduce", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor"]


def _expected(collective: str, n: int, rank: int, count: int) -> torch.Tensor:
    """What the collective leaves in its output when rank r's input is full(r + 1)."""
    if collective == "all_reduce":
        return torch.full((count,), float(n * (n + 1) // 2))
    if collective == "all_gather_into_tensor":
        return torch.cat([torch.full((count,), float(r + 1)) for r in range(n)])
    if collective == "reduce_scatter_tensor":
        return torch.full((count // n,), float(n * (n + 1) // 2))
    return torch.full((count,), float(n))  # broadcast from rank n - 1


def _issue(collective: str, n: int, rank: int, count: int, async_op: bool):
    t = torch.full((count,), float(rank + 1))
    if collective == "all_reduce":
        return t, dist.all_reduce(t, async_op=async_op)
    if collective == "all_gather_into_tensor":
        out = torch.zeros(n * count)
        return out, dist.all_gather_into_tensor(out, t, async_op=async_op)
    if collective == "reduce_scatter_tensor":
        out = torch.zeros(count // n)
        return out, dist.reduce_scatter_tensor(out, t, async_op=async_op)
    return t, dist.broadcast(t, src=n - 1, async_op=async_op)


def _case_works_and_futures(ctx, collective):
    """Sync, then async with wait(), wait(timeout), get_future().wait(), a then() callback whose
    chained value the caller sees, a then() attached after completion, and is_completed() polled,
    at a small and a large size; each returns within seconds."""
    n, rank = ctx.world_size, ctx.rank
    problems = []
    for count in (4 * 4099, 1 << 20):
        label = f"{collective} count={count}"
        out, _ = _issue(collective, n, rank, count, async_op=False)
        problems += compare(out, _expected(collective, n, rank, count), None, f"{label} sync")
        for how in ("wait", "wait_timeout", "future_wait", "then", "then_after", "poll"):
            out, work = _issue(collective, n, rank, count, async_op=True)
            started = time.monotonic()
            if how == "wait":
                work.wait()
                got = out
            elif how == "wait_timeout":
                work.wait(timeout=datetime.timedelta(seconds=60))
                got = out
            elif how == "future_wait":
                value = work.get_future().wait()
                got = value[0] if isinstance(value, list) and value else None
            elif how == "then":
                got = work.get_future().then(lambda f: f.value()[0] * 2).wait() / 2
            elif how == "then_after":
                work.wait()
                got = work.get_future().then(lambda f: f.value()[0] + 1).wait() - 1
            else:
                deadline = time.monotonic() + 30
                while not work.is_completed() and time.monotonic() < deadline:
                    time.sleep(0.001)
                got = out
            elapsed = time.monotonic() - started
            if got is None:
                problems.append(f"{label} {how}: the future's value is not a list of tensors")
                continue
            problems += compare(got, _expected(collective, n, rank, count), None, f"{label} {how}")
            # After wait() returns (as gloo's, a future may complete just before its work does).
            if how in ("wait", "wait_timeout", "then_after", "poll") and not work.is_completed():
                problems.append(f"{label} {how}: is_completed() is False after the result was read")
            if elapsed > 20:
                problems.append(f"{label} {how}: took {elapsed:.1f} s")
    return problems


@pytest.mark.parametrize("collective", FUTURE_COLLECTIVES)
@pytest.mark.parametrize("route,world_size", FLAT_ROUTE_SIZES, ids=_ids(FLAT_ROUTE_SIZES))
def test_works_and_futures(route, world_size, collective):
    _check(route, world_size, _case_works_and_futures, collective)


@pytest.mark.parametrize("route,world_size", ROUTE_SIZES, ids=_ids(ROUTE_SIZES))
def test_ddp(route, world_size):
    """DDP trains to the one-process reference, replicas bitwise alike (the case test_cuda runs on a GPU)."""
    _check(route, world_size, cuda_cases._case_ddp_on_cuda, timeout=180)


@pytest.mark.parametrize("form", ["future_wait", "sync", "two_levels", "interleaved"])
@pytest.mark.parametrize("route,world_size", FLAT_ROUTE_SIZES, ids=_ids(FLAT_ROUTE_SIZES))
def test_collective_from_callback(route, world_size, form):
    """A collective issued from a then() callback runs on the worker inside its callback (the case test_cuda runs on a GPU)."""
    _check(route, world_size, cuda_cases._case_callbacks_on_cuda, form)


@pytest.mark.parametrize("route,world_size", FLAT_ROUTE_SIZES, ids=_ids(FLAT_ROUTE_SIZES))
def test_powersgd(route, world_size):
    """DDP with PowerSGD, many buckets, against gloo one bucket at a time (the case test_cuda runs on a GPU)."""
    _check(route, world_size, cuda_cases._case_powersgd_on_cuda, timeout=180)


@pytest.mark.parametrize("route", ["arenas", "staged"])
def test_timeout_names_absent_rank(route):
    opts = _route_options(route, 2)
    results = harness.run_job(BACKEND, 2, _on_route, cuda_cases._case_cuda_timeout, options=opts, timeout=90)
    harness.conclude(harness.problems(results), None, f"host device {route} timeout")


# ------------------------------------------------------------------------------ routes in the log


class _Stderr:
    """What this process writes to file descriptor 2 (C++ logs included) inside the block."""

    def __enter__(self):
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()


def _case_route_logs(ctx, route):
    """At info every rank logs which ranks' arenas it agreed on; at debug every collective its
    device route."""
    rank, n = ctx.rank, ctx.world_size
    with _Stderr() as err:
        ctx.init_process_group(init="file", pg_options=_options_object(route, n, rank, log_level="debug"))
        t = torch.ones(4099)
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(4099 * n), torch.ones(4099))
        dist.destroy_process_group()
    problems = []
    if not torch.equal(t, torch.full((4099,), float(n))):
        problems.append(f"all_reduce gave {t[:3].tolist()}")
    agreed = {"arenas": ",".join(map(str, range(n))), "staged": str(rank),
              "mixed": ",".join(map(str, [r for r in range(n) if r // 2 == rank // 2]))}[route]
    if f"ranks with arenas here: {agreed} " not in err.text:
        problems.append(f"no info line 'ranks with arenas here: {agreed}' in:\n{err.text[-1500:]}")
    routes = re.findall(r"on the device, \S+ runs as ([^\n]+)", err.text)
    want = {"arenas": "cuda_ipc", "staged": "staged", "mixed": "torus (rows cuda_ipc, columns staged)"}[route]
    if route != "mixed" and not routes or any(r != want for r in routes[:1]):
        problems.append(f"device routes logged {routes}, expected {want!r}:\n{err.text[-1500:]}")
    return problems


def _options_object(route, n, rank, **more):
    import torch_torus

    options = _route_options(route, n, **more)
    options["host_id"] = options["host_id"].format(rank=rank, rank_pair=rank // 2)
    return torch_torus.Options(**options)


@pytest.mark.parametrize("route,world_size", [("arenas", 2), ("staged", 2)], ids=["arenas-ws2", "staged-ws2"])
def test_route_logs(route, world_size):
    results = harness.run_job(BACKEND, world_size, _case_route_logs, route, timeout=90)
    harness.conclude(harness.problems(results), None, f"route logs {route}")


# ------------------------------------------------------------------------------ stalls and failures

STALL_S = 1.5


def _case_stall(ctx, fault, expect, collective):
    """Every rank's device layer plays `fault`; the collective must fail on every rank within a
    few stall bounds (not the group's 60 s timeout) with DistBackendError naming the phase
    (`expect`), the collective and the rank."""
    rank, n = ctx.rank, ctx.world_size
    ctx.init_process_group(init="file", timeout=datetime.timedelta(seconds=60),
                           pg_options=_options_object("arenas", n, rank, host_device=fault,
                                                      device_stall_timeout=f"{STALL_S}s"))
    started = time.monotonic()
    try:
        if collective == "all_reduce":
            dist.all_reduce(torch.ones(1 << 16))
        else:
            dist.all_gather_into_tensor(torch.empty(n << 16), torch.ones(1 << 16))
    except Exception as error:  # noqa: BLE001 - what we are here to look at
        elapsed = time.monotonic() - started
        text = str(error)
        problems = []
        if not isinstance(error, dist.DistBackendError):
            problems.append(f"raised {type(error).__name__}, not DistBackendError: {text[:400]}")
        if elapsed > 4 * STALL_S + 5:
            problems.append(f"raised after {elapsed:.1f} s; the stall bound is {STALL_S} s")
        if not re.search(expect, text):
            problems.append(f"the error does not name {expect!r}: {text[:600]}")
        if f"rank {rank} of {n}" not in text:
            problems.append(f"the error does not name rank {rank}: {text[:600]}")
        if collective.replace("_into_tensor", "") not in text:
            problems.append(f"the error does not name {collective}: {text[:600]}")
        return problems
    return [f"{collective} returned although the device layer played {fault}"]


STALLS = [
    ("stall:copy into the arena", r"stalled in arena_reduce_scatter copy into the arena, round 0\b.*stall bound of 1500 ms",
     "all_reduce"),
    ("stall:copy from the arenas", r"stalled in arena_allgather copy from the arenas, round 0", "all_gather_into_tensor"),
    ("stall:ready", r"ready event", "all_reduce"),
    ("stall:done", r"done event", "all_reduce"),
]


@pytest.mark.parametrize("fault,expect,collective", STALLS, ids=[s[0].split(":")[1].replace(" ", "_") for s in STALLS])
def test_stall_names_phase(fault, expect, collective):
    results = harness.run_job(BACKEND, 2, _case_stall, fault, expect, collective, timeout=60)
    harness.conclude(harness.problems(results), None, f"stall {fault}")


def _case_enter_fails(ctx):
    """Rank 0's device layer cannot enter the call: rank 0 raises naming it, and rank 1, whose
    peer will never send, raises promptly too (the group fails), not at the group's timeout."""
    rank, n = ctx.rank, ctx.world_size
    fault = "fail:enter" if rank == 0 else "on"
    ctx.init_process_group(init="file", timeout=datetime.timedelta(seconds=60),
                           pg_options=_options_object("arenas", n, rank, host_device=fault))
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16))
    except Exception as error:  # noqa: BLE001
        elapsed, text = time.monotonic() - started, str(error)
        problems = []
        if elapsed > 15:
            problems.append(f"rank {rank} raised after {elapsed:.1f} s (group timeout 60 s)")
        if rank == 0 and "failed to enter" not in text:
            problems.append(f"rank 0's error does not say it failed to enter the call: {text[:500]}")
        if rank != 0 and not re.search(r"rank 0\b", text):
            problems.append(f"rank {rank}'s error does not name rank 0: {text[:500]}")
        # Rank 0's own failure keeps its type (a device error); its peers' is the group's.
        if not isinstance(error, RuntimeError if rank == 0 else dist.DistBackendError):
            problems.append(f"rank {rank} raised {type(error).__name__}: {text[:300]}")
        return problems
    return [f"rank {rank}: all_reduce returned although rank 0 could not enter it"]


def test_enter_failure_fails_the_group():
    results = harness.run_job(BACKEND, 2, _case_enter_fails, timeout=60)
    harness.conclude(harness.problems(results), None, "enter failure")


def _case_wait_watch(ctx):
    """Debug mode: a wait() held up after its collective completed (here by the done event that
    never comes) is reported while it waits, naming the collective."""
    rank, n = ctx.rank, ctx.world_size
    with _Stderr() as err:
        ctx.init_process_group(init="file", pg_options=_options_object(
            "arenas", n, rank, host_device="stall:done", device_stall_timeout="3s", log_level="debug"))
        work = dist.all_reduce(torch.ones(64), async_op=True)
        try:
            work.wait()
            raised = None
        except Exception as error:  # noqa: BLE001
            raised = error
        dist.destroy_process_group()
    problems = []
    if raised is None or "done event" not in str(raised):
        problems.append(f"wait() did not raise naming the done event: {raised!r:.300}")
    if not re.search(r"all_reduce\S* #1 .*completed \d+ ms ago, but its wait\(\) has not returned", err.text):
        problems.append(f"no report of the wait that did not return in:\n{err.text[-1500:]}")
    return problems


def test_debug_reports_wait_that_does_not_return():
    results = harness.run_job(BACKEND, 2, _case_wait_watch, timeout=60)
    harness.conclude(harness.problems(results), None, "wait watch")
