"""pytest wiring for the multi-process harness (see harness.py).

* ``backend`` fixture: parametrized over TORUS_TEST_BACKENDS (comma separated, default
  "torus+shm,torus+tcp": torus over each transport, see harness.split_backend; modules that set
  ``TRANSPORT_CONTRACT = True`` also run over "torus+ofi", skipped with the reason in a build
  without libfabric);
  ``TORUS_TEST_BACKENDS=gloo`` runs the very same tests against gloo, to validate the tests
  themselves.  In the default matrix, cases that repeat others are left out (deselected):
  see repeats_another_case.  Per-backend deviations live in ONE table: expectations.py.
* Pools are session-scoped (harness._POOLS) and torn down at session end.
* No hang, ever: every case has its own bound inside the harness (TORUS_TEST_TIMEOUT, 60 s
  default); on top of that each test runs under a hard per-test limit
  (TORUS_TEST_HARD_LIMIT, 900 s default, 0 = off) enforced with faulthandler: if a test
  itself ever exceeds it, all thread stacks are dumped and the pytest process exits (the
  workers then notice their parent is gone and exit too).  If pytest-timeout is installed,
  ``--timeout`` works as usual as an extra safety net.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

BACKENDS = [b.strip() for b in os.environ.get("TORUS_TEST_BACKENDS", "torus+shm,torus+tcp").split(",")
            if b.strip()]
# The suites every transport must pass (collectives, point-to-point, faults, flow control,
# timeouts) run over OFI too unless TORUS_TEST_BACKENDS chooses the backends.
OFI_BACKEND = "torus+ofi"
CONTRACT_BACKENDS = BACKENDS if "TORUS_TEST_BACKENDS" in os.environ else BACKENDS + [OFI_BACKEND]

HARD_LIMIT = float(os.environ.get("TORUS_TEST_HARD_LIMIT", "900") or 0)

# The flight recorders' dumps of the groups the tests fail on purpose go to one directory of the
# session (every rank and torchrun's children inherit it), not the default under /tmp.
os.environ.setdefault("TORUS_TRACE_DIR", tempfile.mkdtemp(prefix="test-traces-"))


def pytest_configure(config):
    config.addinivalue_line("markers", "harness: tests of the test harness itself")


def pytest_report_header(config):
    return (f"torus harness: backends={BACKENDS} case bound={harness.DEFAULT_TIMEOUT:g}s "
            f"grace={harness.DEFAULT_GRACE:g}s start-up bound={harness.STARTUP_TIMEOUT:g}s "
            f"hard per-test limit={HARD_LIMIT:g}s")


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        backends = CONTRACT_BACKENDS if getattr(metafunc.module, "TRANSPORT_CONTRACT", False) else BACKENDS
        params = []
        for backend in backends:
            skip = harness.split_backend(backend)[1].get("TORUS_TRANSPORT", "").endswith("ofi") and harness.without_ofi()
            params.append(pytest.param(backend, marks=pytest.mark.skip(reason=skip)) if skip else backend)
        metafunc.parametrize("backend", params)


def case_params(item) -> dict:
    """A collected case's parameters (none for an unparametrized test)."""
    return getattr(getattr(item, "callspec", None), "params", {})


def repeats_another_case(item) -> bool:
    """In the default matrix, a case that another covers: a group of one rank moves no bytes, so
    its cases run over the first transport only; over OFI, whose contract suites repeat what shm
    and tcp run, at 2, 4 and 8 ranks (the algorithms' odd sizes are the same whatever carries
    the bytes, and run over shm and tcp)."""
    params = case_params(item)
    if "TORUS_TEST_BACKENDS" in os.environ or "backend" not in params or "world_size" not in params:
        return False
    backend, world_size = params["backend"], params["world_size"]
    return (world_size == 1 and backend != BACKENDS[0]) or (backend == OFI_BACKEND and world_size == 3)


def pool_key(item) -> tuple:
    """The pool a case runs on, as far as its parameters say: (backend, world size)."""
    params = case_params(item)
    return str(params.get("backend", "")), repr(params.get("world_size", ""))


def pytest_collection_modifyitems(config, items):
    repeats = [item for item in items if repeats_another_case(item)]
    if repeats:
        config.hook.pytest_deselected(items=repeats)
        items[:] = [item for item in items if not repeats_another_case(item)]
    # Within each module, the cases of one pool run together. pytest orders them function by
    # function, each going through every (backend, world size): more workers than the harness
    # keeps (MAX_WORKERS), so its LRU let each pool go just before it was needed again and most
    # cases started a pool of their own.
    modules: dict = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], len(modules))
    items.sort(key=lambda item: (modules[item.nodeid.split("::")[0]], pool_key(item)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if HARD_LIMIT > 0:
        faulthandler.dump_traceback_later(HARD_LIMIT, exit=True)
    try:
        yield
    finally:
        if HARD_LIMIT > 0:
            faulthandler.cancel_dump_traceback_later()


def pytest_sessionfinish(session, exitstatus):
    harness.shutdown_all()


# Why tests skip, by cause, for the run's last lines: (cause, words of the skip reasons it covers).
SKIP_CAUSES = [
    ("no GPU or no CUDA build", ("no GPU", "built without CUDA", "without its CUDA path", "nvcc", "CUDA")),
    ("no MPI", ("mpi4py", "mpiexec", "MPI")),
    ("no network namespaces", ("emulate a cluster",)),
    ("a limit of libfabric's shm provider", ("libfabric's shm provider",)),
    ("no libfabric", ("libfabric",)),
    ("a dtype/op pair every device rejects", ("rejected on every device",)),
    ("not for this backend", ("TORUS_TEST_BACKENDS", "torus's", "gloo")),
    ("variants left out by design", ("many buckets matter", "once, at one point", "not checked", "tested as such")),
]


def skip_causes(reasons):
    """{cause: count} for skip reasons (a reason matching no cause counts as "other")."""
    counts = {}
    for reason in reasons:
        cause = next((c for c, words in SKIP_CAUSES if any(w in reason for w in words)), "other")
        counts[cause] = counts.get(cause, 0) + 1
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    s = harness.STATS
    # Pools are replaced after any failing case, expected failures (xfail) included.
    terminalreporter.write_line(
        f"torus harness: {s['pools_started']} pools started ({s['workers_started']} worker "
        f"processes incl. one-off jobs), {s['startup_seconds']:.1f}s in pool start-up, "
        f"{s['pools_killed_on_failure']} replaced after a case that failed or was expected to")
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = [report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
               for report in skipped]
    if reasons:
        counts = skip_causes(reasons)
        terminalreporter.write_line(
            f"skipped {len(reasons)}: " + ", ".join(f"{n} {cause}" for cause, n in
                                                     sorted(counts.items(), key=lambda item: -item[1]))
            + " (pytest -rs lists each)")
