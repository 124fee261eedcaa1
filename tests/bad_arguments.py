"""Bad arguments to every collective torch.distributed offers (issue 5: never hang, never corrupt,
always say who).

Each scenario below makes one bad call: a tensor on the wrong device or sparse, mixed dtypes in
a list, a wrong size or list length, a root/src/dst/peer out of range, splits that do not add
up, an output whose elements share memory (expand()), an unsupported dtype or (op, dtype) pair,
a non-positive per-call timeout. The call must raise ValueError or RuntimeError (not
DistBackendError: that would mean it reached the wire) on the calling rank, with a message that
names the argument at fault (its name as torch.distributed spells it, or its index in a list,
or its bad value), and leave every tensor it was given untouched.

"solo" scenarios make the bad call on ONE rank only (the last); the others do not call at all.
Then every rank runs a good all_reduce (and for point-to-point scenarios, a ring of
isend/irecv) and checks its result. Had the bad call queued or sent anything, that good
collective would pair with it and fail or give a wrong answer: so it passing proves that
nothing moved and nothing is left waiting. "all" scenarios are bad on every rank alike (an
out-of-range root, say) and every rank must raise; the object variants are "all" because
torch's object functions run collectives of their own before the one that is refused.

Some checks are torch's, in its Python layer or its dispatcher, before any backend sees the
call (mixed dtypes, a sparse tensor where no backend kernel exists, sending to oneself): what
counts is what the user sees, so those are here too. A tensor that is ALL on the meta device
never reaches a backend at all: torch registers Meta kernels for the c10d ops that return a
FakeWork (torch/distributed/_meta_registrations.py, for tracing meta models), so such a call
is a local no-op; the "meta" scenario checks exactly that (no error, nothing moved, the group
fine). A meta tensor among CPU ones does reach the backend, which must refuse it.

gloo's deviations are in expectations.py ("bad_args.<scenario>").

The scenarios are in test_bad_arguments.py (the collectives) and test_bad_arguments_p2p.py
(point to point, barrier, the object variants); this module holds what they share: the
scenario's shape, the helpers that build bad arguments, and the case every rank runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import re
import warnings
from typing import Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
from reference import first_line

WORLD_SIZES = [2, 3]
# How long the good collective after a bad call may take before the group counts as stuck; the
# case bound is above it so that a stuck group is reported by the case, with its problems.
AFTER_TIMEOUT_S = 5.0
CASE_BOUND_S = 15.0
SENTINEL = 7.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    # (world_size, calling rank) -> (the bad call, tensors it must leave untouched,
    #                                regexes that must all match the error message)
    build: Callable
    mode: str = "solo"  # "solo": only the last rank calls; "all": every rank calls
    p2p: bool = False  # also check a ring of sends and receives afterwards
    torch_noop: bool = False  # torch handles the call without the backend (see module doc)


def registrar(scenarios: Dict[str, Scenario]):
    """The decorator that adds a scenario to `scenarios` (a test module's) under its name."""

    def scenario(name: str, mode: str = "solo", p2p: bool = False, torch_noop: bool = False):
        def register(build):
            assert name not in scenarios, name
            scenarios[name] = Scenario(build, mode, p2p, torch_noop)
            return build

        return register

    return scenario


def full(*shape, dtype=torch.float32):
    return torch.full(shape, SENTINEL, dtype=dtype)


def expanded(numel: int) -> torch.Tensor:
    """A tensor whose elements all share one memory location."""
    return torch.full((1,), SENTINEL).expand(numel)


def meta(*shape):
    return torch.empty(shape, device="meta")


def sparse(numel: int) -> torch.Tensor:
    return torch.full((numel,), SENTINEL).to_sparse()


def premul_sum(factor: float):
    return dist._make_nccl_premul_sum(factor)


INDEX = r"(?:\[{i}\]|index {i}\b|tensor {i}\b)"


def at(i: int) -> str:
    return INDEX.format(i=i)


# ------------------------------------------------------------------------------- the case

def _wait(start: Callable, what: str) -> List[str]:
    """Start a work and wait for it, bounded; a problem if either fails."""
    try:
        start().wait(timeout=datetime.timedelta(seconds=AFTER_TIMEOUT_S))
    except Exception as e:
        return [f"{what} after the bad call failed: {first_line(e)}"]
    return []


def _group_still_works(rank: int, n: int, p2p: bool) -> List[str]:
    """A good all_reduce (and a ring of sends) on every rank, each wait bounded."""
    t = torch.full((5,), float(rank + 1))
    problems = _wait(lambda: dist.all_reduce(t, async_op=True), "all_reduce")
    if problems:
        return problems
    want = n * (n + 1) / 2
    if not bool((t == want).all()):
        return [f"all_reduce after the bad call gave {t.tolist()}, expected {want}"]
    if p2p:
        got = torch.zeros(6)
        try:
            recv = dist.irecv(got, src=(rank - 1) % n)
            send = dist.isend(torch.full((6,), 10.0 * rank + 1), dst=(rank + 1) % n)
        except Exception as e:
            return [f"a ring isend/irecv after the bad call failed: {first_line(e)}"]
        problems = _wait(lambda: send, "a ring isend") + _wait(lambda: recv, "a ring irecv")
        if problems:
            return problems
        expect = 10.0 * ((rank - 1) % n) + 1
        if not bool((got == expect).all()):
            return [f"the ring receive after the bad call got {got.tolist()}, expected {expect} "
                    "(a stale message from the bad call?)"]
    return []


def case_bad(ctx, module: str, name: str) -> List[str]:
    sc = importlib.import_module(module).SCENARIOS[name]
    n, rank = ctx.world_size, ctx.rank
    problems: List[str] = []
    if sc.mode == "all" or rank == n - 1:
        call, watched, names = sc.build(n, rank)
        before = [w.clone() for w in watched]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = call()
            for work in result if isinstance(result, list) else [result]:
                if hasattr(work, "wait"):  # an async form: its error may come at wait()
                    work.wait(timeout=datetime.timedelta(seconds=AFTER_TIMEOUT_S))
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            if sc.torch_noop:
                problems.append(f"raised, where torch's Meta kernel makes the call a local no-op: "
                                f"{first_line(e)}")
            elif isinstance(e, dist.DistBackendError) or not isinstance(e, (ValueError, RuntimeError)):
                problems.append(f"raised {type(e).__name__}, not a ValueError or RuntimeError at the "
                                f"call: {first_line(e)}")
            else:
                missing = [p for p in names if not re.search(p, text, re.I | re.S)]
                if missing:
                    problems.append(f"the error does not name the argument at fault (wanted "
                                    f"{' and '.join(map(repr, missing))}): {first_line(e)}")
        else:
            if not sc.torch_noop:
                problems.append("the bad call was accepted (no error)")
        for i, (w, b) in enumerate(zip(watched, before)):
            if not torch.equal(w, b):
                problems.append(f"the bad call changed the tensor it was given (watched tensor {i})")
    problems += _group_still_works(rank, n, sc.p2p)
    return [f"{name}: {p}" for p in problems]


def check(backend: str, world_size: int, module: str, name: str) -> None:
    """Runs scenario `name` of test module `module` on `world_size` ranks, checked against what
    `backend` is expected to do."""
    gap = expectations.gap(backend, f"bad_args.{name}", world_size=world_size)
    if gap is not None and gap.skip:
        pytest.skip(str(gap))
    try:
        found = harness.problems(harness.run(backend, world_size, case_bad, module, name, timeout=CASE_BOUND_S))
    except harness.CaseFailure as failure:  # a rank raised outside the checks, died or hung
        found = [f"{name}: the case failed: {failure}"]  # (the harness killed the pool)
    if found:  # whatever happened, do not hand a group that may be out of step to the next test
        harness.discard_pool(backend, world_size)
    harness.conclude(found, gap, f"{backend} world_size={world_size}")
