"""torch's own distributed test suite against torus.

Runs torch.testing._internal.distributed.distributed_test at 2 ranks the way torch runs it for
gloo (BACKEND=gloo: the tests that select gloo run, the others skip), with every process group
created as torus instead of gloo: init_process_group and new_group get backend "torus" wherever
a test asks for gloo. Prints one line per test and a summary::

    python tests/torch_suite.py                                    # every test, torus
    python tests/torch_suite.py --backends gloo,torus              # gloo beside it
    python tests/torch_suite.py -k monitored_barrier -k sparse_all_reduce

Each test runs in a python process of its own (the suite spawns the 2 ranks from it), in a new
session that is killed after --timeout seconds (default 120); tests that torch skips by
decorator are reported without starting one. Needs expecttest (pip install expecttest), which
torch's test utilities import. Known differences that are not bugs: test_get_backend and
test_ddp_logging_data_cpu compare the backend's name with "gloo" (DDP's logger calls any
third-party backend "custom").
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

WORLD_SIZE = "2"
# What the child reports on its last line of output.
OUTCOME_PREFIX = "torch_suite outcome: "


def _suite_environment(temp_dir: str) -> None:
    """The variables distributed_test reads when it is imported; the tests' processes inherit them."""
    os.environ["BACKEND"] = "gloo"  # the tests that select gloo, whichever backend runs them
    os.environ["WORLD_SIZE"] = WORLD_SIZE
    os.environ["TEMP_DIR"] = temp_dir
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def _suite_class():
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """As torch's test/distributed/test_distributed_spawn.py builds it."""

        def setUp(self):
            super().setUp()
            self._spawn_processes()

    # The ranks unpickle the class by name: as this module's global, not a local of this function.
    TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
    return TestDistBackendWithSpawn


def _create_groups_as_torus() -> None:
    """Every process group a test creates for gloo is created as torus (in this process and in
    the ranks, which import this module)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import torch_torus  # noqa: F401 - registers "torus"; dist.monitored_barrier takes torus groups

    def as_torus(backend):
        return "torus" if backend is None or str(backend).lower() == "gloo" else backend

    torch_init, torch_new_group = c10d.init_process_group, c10d.new_group

    def init_process_group(backend=None, *args, **kwargs):
        return torch_init(as_torus(backend), *args, **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        # backend=None takes the default group's, which is torus already.
        return torch_new_group(ranks, timeout, None if backend is None else as_torus(backend), *args, **kwargs)

    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.new_group = new_group


if os.environ.get("TORCH_SUITE_BACKEND"):
    # Imported as a test's process or as one of its ranks (spawned, they import this module): the
    # suite's class must be this module's, for the ranks to find it.
    if os.environ["TORCH_SUITE_BACKEND"] == "torus":
        _create_groups_as_torus()
    TestDistBackendWithSpawn = _suite_class()


def _run_one(name: str) -> int:
    """In the test's own process: runs one test, prints its outcome."""
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(
        unittest.defaultTestLoader.loadTestsFromName(name, TestDistBackendWithSpawn))
    if result.errors or result.failures:
        outcome = "failed"
    elif result.skipped:
        outcome = "skipped"
    else:
        outcome = "passed"
    print(OUTCOME_PREFIX + outcome, flush=True)
    return 0


def _test_names(patterns: list[str]) -> list[tuple[str, bool]]:
    """(name, skipped by a decorator) for every test of the suite matching one of the patterns."""
    cls = _suite_class()
    names = unittest.defaultTestLoader.getTestCaseNames(cls)
    chosen = [n for n in names if not patterns or any(p in n for p in patterns)]
    return [(n, bool(getattr(getattr(cls, n), "__unittest_skip__", False))) for n in chosen]


def _run_in_process(name: str, backend: str, timeout: float) -> tuple[str, float, str]:
    """(outcome, seconds, output) of one test in a new session, killed after `timeout`."""
    env = dict(os.environ, TORCH_SUITE_BACKEND=backend,
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(int(timeout)))
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--run-one", name],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout + 30)  # the suite's own bound comes first
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return "timed out", time.monotonic() - started, output
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # ranks left behind by a failed test
        except ProcessLookupError:
            pass
    outcomes = [line[len(OUTCOME_PREFIX):] for line in output.splitlines() if line.startswith(OUTCOME_PREFIX)]
    return (outcomes[-1] if outcomes else f"crashed (exit {process.returncode})"), time.monotonic() - started, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="torus", help="comma separated: torus, gloo (default: torus)")
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run the tests whose name contains this (repeatable; default: all)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per test (default 120)")
    parser.add_argument("--show-output", action="store_true", help="print the output of every test that failed")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        return _run_one(args.run_one)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for backend in backends:
        if backend not in ("torus", "gloo"):
            parser.error(f"--backends: {backend!r} is neither torus nor gloo")
    with tempfile.TemporaryDirectory(prefix="torus-torch-suite-") as temp_dir:
        _suite_environment(temp_dir)
        tests = _test_names(args.patterns)
        print(f"torch_suite: {len(tests)} tests of distributed_test at {WORLD_SIZE} ranks (BACKEND=gloo), "
              f"run as {', '.join(backends)}, {args.timeout:g} s each", flush=True)
        counts = {b: {} for b in backends}
        for name, skipped in tests:
            cells = []
            for backend in backends:
                if skipped:
                    outcome, seconds, output = "skipped", 0.0, ""
                else:
                    outcome, seconds, output = _run_in_process(name, backend, args.timeout)
                counts[backend][outcome] = counts[backend].get(outcome, 0) + 1
                cells.append(f"{backend} {outcome} ({seconds:.0f} s)")
                if args.show_output and outcome not in ("passed", "skipped"):
                    print(output[-6000:], flush=True)
            print(f"{name}: {'; '.join(cells)}", flush=True)
    for backend in backends:
        summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts[backend].items()))
        print(f"torch_suite {backend}: {summary}", flush=True)
    return 0 if all(set(c) <= {"passed", "skipped"} for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
