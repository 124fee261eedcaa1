"""Timeouts (issue 5: never hang, always say who).

Three ranks; the last one stops calling collectives (it sleeps). The other two must, at the
group's timeout (init_process_group(timeout=...) and new_group(timeout=...), 2 s here), raise
torch.distributed.DistBackendError naming the collective, its sequence number and the rank they
waited for: the absent one (a rank blocked behind another that waits for it names the rank it
waits on, which is not the one to look at). After that, later calls on the group fail at once
with an error that says the group is broken. Work.wait(timeout=...) on an async work raises at
that timeout (torch documents "If timeout, exception will be thrown"), naming the same. Every
such error also carries the words torch's own tests match (reference.TORCH_ERROR_WORDS).

Every operation runs at once on its own group (one per operation, so each fails by itself),
issued asynchronously and then waited for: one job of about four timeouts per backend, rather
than one per operation. The world group itself carries the ring allreduce, so that
init_process_group(timeout=...) is what is tested there.

Properties are separate tests reading one run per backend. What torus does not say yet is
marked xfail(strict=True) with what is missing (KNOWN_MISSING): remove an entry when it passes.
gloo's deviations are in expectations.py ("timeouts.*").
"""

from __future__ import annotations

import datetime
import re
import time
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
from reference import TORCH_ERROR_WORDS

# Every transport keeps these promises: they also run over OFI (conftest.py).
TRANSPORT_CONTRACT = True

WORLD_SIZE = 3
ABSENT = WORLD_SIZE - 1  # the rank that stops calling collectives
TIMEOUT_S = 2.0  # the groups' timeout
WAIT_TIMEOUT_S = 1.0  # Work.wait(timeout=...) on a group whose own timeout is long
LONG_TIMEOUT_S = 60.0
FAIL_FAST_S = 0.5  # a call on a broken group must fail within this
BIG = 4 << 20  # float32 elements of a send: 16 MiB, more than any socket or shared-memory buffer

# operation -> what it is called in errors, and its torus allreduce algorithm (if any)
OPS = {
    "all_reduce.ring": (r"all_?reduce", "ring"),
    "all_reduce.one_shot": (r"all_?reduce", "one_shot"),  # over tcp torus runs recursive_doubling
    "broadcast": (r"broadcast", None),
    "all_gather": (r"all_?gather", None),
    "barrier": (r"barrier", None),
    "send": (r"send", None),
    "recv": (r"recv", None),
    "work_wait_timeout": (r"all_?reduce", None),
}
PROPERTIES = ["raises_dist_backend_error", "at_the_timeout", "names_collective",
              "names_sequence_number", "names_absent_rank", "has_torch_words", "fails_fast_after"]

# (transport or "*", operation, property) -> why it fails now
KNOWN_MISSING: Dict = {}


def _outcome(started: float, error: BaseException | None) -> Dict:
    return {"elapsed": time.monotonic() - started,
            "type": None if error is None else type(error).__name__,
            "is_dist_backend_error": isinstance(error, dist.DistBackendError),
            "message": "" if error is None else str(error)}


def _wait(work, timeout_s: float | None = None) -> BaseException | None:
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # noqa: BLE001 - what we are here to look at
        return error
    return None


def _case_absent_rank(ctx) -> Dict:
    """The world group (TORUS_ALLREDUCE=ring, from the job's environment) carries the ring
    allreduce; every other operation gets a group of its own."""
    import torch_torus

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    ctx.init_process_group(init="file", timeout=timeout)
    torus = ctx.backend == "torus"

    def group(op, seconds=TIMEOUT_S):
        algorithm = OPS[op][1]
        kw = {"pg_options": torch_torus.Options(allreduce=algorithm)} if torus and algorithm else {}
        return ctx.new_group(list(range(WORLD_SIZE)), timeout=datetime.timedelta(seconds=seconds), **kw)

    groups = {op: group(op) for op in OPS if op not in ("all_reduce.ring", "work_wait_timeout")}
    groups["all_reduce.ring"] = dist.group.WORLD
    groups["work_wait_timeout"] = group("work_wait_timeout", LONG_TIMEOUT_S)
    for g in groups.values():  # collective #1 of every group, with everybody
        dist.all_reduce(torch.ones(4), group=g)
    if ctx.rank == ABSENT:
        # Stay away until the others have timed out (each at TIMEOUT_S) and checked what
        # follows (a group that does not fail fast takes another TIMEOUT_S, twice at worst).
        time.sleep(4 * TIMEOUT_S + 2)
        # Let the work whose Work.wait timed out finish (its group's timeout is long), so that
        # nobody waits for it when the processes shut down.
        _wait(dist.all_reduce(torch.ones(1000), group=groups["work_wait_timeout"], async_op=True), 5.0)
        return {}

    t = {op: torch.ones(1000) for op in OPS}
    started = time.monotonic()
    works = {
        "work_wait_timeout": dist.all_reduce(t["work_wait_timeout"], group=groups["work_wait_timeout"],
                                             async_op=True),
        "all_reduce.ring": dist.all_reduce(t["all_reduce.ring"], group=groups["all_reduce.ring"], async_op=True),
        "all_reduce.one_shot": dist.all_reduce(t["all_reduce.one_shot"], group=groups["all_reduce.one_shot"],
                                               async_op=True),
        "broadcast": dist.broadcast(t["broadcast"], src=ABSENT, group=groups["broadcast"], async_op=True),
        "all_gather": dist.all_gather([torch.zeros(1000) for _ in range(WORLD_SIZE)], t["all_gather"],
                                      group=groups["all_gather"], async_op=True),
        "barrier": dist.barrier(group=groups["barrier"], async_op=True),
        "send": dist.isend(torch.ones(BIG), dst=ABSENT, group=groups["send"]),
        "recv": dist.irecv(t["recv"], src=ABSENT, group=groups["recv"]),
    }
    results = {"work_wait_timeout": _outcome(started, _wait(works["work_wait_timeout"], WAIT_TIMEOUT_S))}
    for op, work in works.items():
        if op != "work_wait_timeout":
            results[op] = _outcome(started, _wait(work))
    for op, g in groups.items():
        if op == "work_wait_timeout":
            continue  # its group's own timeout is long: what follows a Work.wait timeout is not checked
        began = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3), group=g)
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        results[op]["after"] = _outcome(began, error)
    return results


_RUNS: Dict[str, object] = {}


def _run(backend: str):
    """One job per backend, shared by every property test (a failure is kept and re-raised)."""
    if backend not in _RUNS:
        try:
            _RUNS[backend] = harness.run_job(backend, WORLD_SIZE, _case_absent_rank, init="none",
                                             env={"TORUS_ALLREDUCE": "ring"}, timeout=60)
        except harness.CaseFailure as failure:
            _RUNS[backend] = failure
    if isinstance(_RUNS[backend], BaseException):
        raise _RUNS[backend]
    return _RUNS[backend]


def _problems(prop: str, op: str, rank: int, r: Dict) -> List[str]:
    message, where = r["message"], f"rank {rank}: {op}"
    if r["type"] is None:
        return [f"{where}: returned after {r['elapsed']:.1f}s instead of raising"]
    limit = WAIT_TIMEOUT_S if op == "work_wait_timeout" else TIMEOUT_S
    if prop == "raises_dist_backend_error" and not r["is_dist_backend_error"]:
        return [f"{where}: raised {r['type']}, not DistBackendError: {message[:300]}"]
    if prop == "at_the_timeout" and not (0.8 * limit <= r["elapsed"] <= limit + 5):
        return [f"{where}: raised after {r['elapsed']:.2f}s; the timeout was {limit}s"]
    if prop == "names_collective" and not re.search(OPS[op][0], message, re.I):
        return [f"{where}: the error does not name the collective: {message[:300]}"]
    if prop == "names_sequence_number":
        wanted = r"#\s*\d+|seq" if op in ("send", "recv") else r"#\s*2\b|seq\w*\W+2\b"
        if not re.search(wanted, message, re.I):
            return [f"{where}: the error does not name the sequence number (2): {message[:300]}"]
    if prop == "names_absent_rank" and not re.search(rf"\brank {ABSENT}\b|\branks\b[^:.;]{{0,40}}\b{ABSENT}\b",
                                                    message, re.I):
        return [f"{where}: the error does not name rank {ABSENT}, which never came: {message[:300]}"]
    if prop == "has_torch_words" and not re.search(TORCH_ERROR_WORDS, message):
        return [f"{where}: the error lacks the words torch matches (/{TORCH_ERROR_WORDS}/): {message[:300]}"]
    if prop == "fails_fast_after":
        after = r["after"]
        if after["type"] is None:
            return [f"{where}: the next all_reduce on the group returned after {after['elapsed']:.1f}s"]
        if after["elapsed"] > FAIL_FAST_S:
            return [f"{where}: the next all_reduce on the group took {after['elapsed']:.2f}s to fail"]
        if not re.search(r"unusable|broken|earlier failure|aborted|gave up|closure|failed", after["message"],
                         re.I):
            return [f"{where}: the next all_reduce's error does not say the group is broken: "
                    f"{after['message'][:300]}"]
    return []


@pytest.mark.parametrize("prop", PROPERTIES)
@pytest.mark.parametrize("op", list(OPS))
def test_timeout(backend, op, prop, request):
    if op == "work_wait_timeout" and prop == "fails_fast_after":
        pytest.skip("torch does not say whether a work outlives its Work.wait(timeout); not checked")
    transport = backend.partition("+")[2]
    why = KNOWN_MISSING.get((transport, op, prop)) or KNOWN_MISSING.get(("*", op, prop))
    if backend.startswith("torus") and why:
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))
    results = _run(backend)
    found = [p for rank in range(WORLD_SIZE) if rank != ABSENT for p in _problems(prop, op, rank, results[rank][op])]
    harness.conclude(found, expectations.gap(backend, f"timeouts.{op}.{prop}", world_size=WORLD_SIZE),
                     f"{backend} {op} {prop}")
