"""The harness's pools, on the parent's side: a Pool starts N worker processes of one spec, sends
them cases, gathers their answers within the case's bound and kills the lot when a rank fails;
the registry caches one live pool per spec for the session (tests/harness.py explains the whole).
"""

from __future__ import annotations

import atexit
import collections
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Dict, List, Optional, Tuple

import multiprocessing as mp

from harness_processes import (DEFAULT_GRACE, DEFAULT_TIMEOUT, MAX_WORKERS, STARTUP_TIMEOUT, CaseFailure,
                               PoolSpec, StartupFailure, _LOG_TAIL, _resolve, _worker_main, free_port,
                               make_spec)


def _fn_ref(fn: Callable) -> Tuple[str, str, str]:
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname:
        raise TypeError(f"{fn!r} is not a module-level function; cases are sent by name")
    mod = sys.modules.get(module_name)
    path = getattr(mod, "__file__", None) or ""
    try:
        if _resolve((module_name, qualname, path)) is not fn:
            raise TypeError
    except Exception:
        raise TypeError(f"{module_name}.{qualname} cannot be found by name; "
                        "cases must be module-level functions") from None
    return (module_name, qualname, os.path.abspath(path) if path else "")


def _signame(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


#: how much of a dead rank's output its failure shows
_CRASH_TAIL = 24000
#: how long gdb may take to read the hung ranks' native stacks
NATIVE_STACKS_TIMEOUT = 15.0


def _native_stacks(pids: Dict[int, int]) -> Dict[int, str]:
    """Every thread's native stack (innermost 16 frames) of each hung rank, by gdb attached in batch
    mode to all of them at once: what faulthandler cannot show, a thread stuck in C++ or in a
    library. Says why not where gdb is missing or too slow."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return {r: "(no native stacks: gdb is not installed)" for r in pids}
    runs = {r: subprocess.Popen([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off",
                                 "-ex", "set print frame-arguments none",
                                 "-ex", "thread apply all bt 16"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r, pid in pids.items()}
    deadline = time.monotonic() + NATIVE_STACKS_TIMEOUT
    stacks = {}
    for r, run in runs.items():
        try:
            text, _ = run.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.kill()
            run.communicate()
            stacks[r] = f"(no native stacks: gdb took over {NATIVE_STACKS_TIMEOUT:g} s)"
            continue
        lines = [line[:200] for line in text.splitlines() if line.startswith(("Thread ", "#"))]
        stacks[r] = "\n".join(lines[:400]) or "(no native stacks; gdb said:)\n" + text[-2000:]
    return stacks


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


class Pool:
    """N worker processes of one PoolSpec (see module docstring)."""

    def __init__(self, spec: PoolSpec):
        self.spec = spec
        self.n = spec.world_size
        self.dir = tempfile.mkdtemp(prefix=f"torus-test-{spec.backend}-w{spec.world_size}-")
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        self.logs: List[str] = []
        self.alive = False
        self.seq = 0
        self.cases_run = 0
        self.started_in = 0.0

    # ------------------------------------------------------------------ life cycle
    def start(self) -> "Pool":
        __tracebackhide__ = True
        ctx = mp.get_context("spawn")
        ports = [free_port() for _ in range(4)]
        rdv = {"file": os.path.join(self.dir, "rendezvous"), "port": ports[0], "ports": ports}
        scratch = os.path.join(self.dir, "scratch")
        os.makedirs(scratch, exist_ok=True)
        t0 = time.monotonic()
        for r in range(self.n):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            log = os.path.join(self.dir, f"rank{r}.log")
            p = ctx.Process(target=_worker_main, name=f"torus-test-rank{r}",
                            args=(r, self.spec, child_conn, log, os.getpid(), rdv, scratch),
                            daemon=True)
            p.start()
            child_conn.close()
            self.procs.append(p)
            self.conns.append(parent_conn)
            self.logs.append(log)
        self.alive = True
        self._gather(0, STARTUP_TIMEOUT, DEFAULT_GRACE, "pool start-up", startup=True)
        self.started_in = time.monotonic() - t0
        return self

    def kill(self) -> None:
        """SIGKILL every worker's process group; forget the pool."""
        for p in self.procs:
            if p.pid is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker leads its own group
            except (ProcessLookupError, PermissionError, OSError):
                pass
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass
        for p in self.procs:
            p.join(10)
        self._close()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the workers to destroy their group and exit; kill what is left."""
        if not self.alive:
            return
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(None))
            except Exception:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _close(self) -> None:
        self.alive = False
        for c in self.conns:
            try:
                c.close()
            except Exception:
                pass
        _forget(self)
        if not os.environ.get("TORUS_TEST_KEEP_LOGS"):
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ running cases
    def run(self, fn: Callable, *args, timeout: Optional[float] = None,
            grace: Optional[float] = None, **kwargs) -> List[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the per-rank results."""
        __tracebackhide__ = True
        if not self.alive:
            raise RuntimeError("pool is not alive")
        ref = _fn_ref(fn)
        self.seq += 1
        seq = self.seq
        data = pickle.dumps((seq, ref, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        self._offsets = [self._log_size(r) for r in range(self.n)]
        broken = {}
        for r, c in enumerate(self.conns):
            try:
                c.send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                broken[r] = repr(e)
        what = f"{ref[0]}.{ref[1]}{self._fmt_args(args, kwargs)}"
        self.cases_run += 1
        try:
            return self._gather(seq, DEFAULT_TIMEOUT if timeout is None else timeout,
                                DEFAULT_GRACE if grace is None else grace, what, broken=broken)
        except CaseFailure:
            raise
        except BaseException:  # KeyboardInterrupt, pytest-timeout, a harness bug: no leftovers
            self.kill()
            raise

    @staticmethod
    def _fmt_args(args, kwargs) -> str:
        parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        s = "(" + ", ".join(parts) + ")"
        return s if len(s) < 300 else s[:297] + "...)"

    def _log_size(self, r: int) -> int:
        try:
            return os.path.getsize(self.logs[r])
        except OSError:
            return 0

    def _log_since(self, r: int, offset: int, tail: int = _LOG_TAIL) -> str:
        try:
            with open(self.logs[r], "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        if len(text) > tail:
            text = "[...]\n" + text[-tail:]
        return text

    def _gather(self, seq: int, timeout: float, grace: float, what: str,
                startup: bool = False, broken: Optional[dict] = None) -> List[Any]:
        __tracebackhide__ = True
        t0 = time.monotonic()
        pending = set(range(self.n))
        results: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        dead: Dict[int, str] = dict(broken or {})
        pending -= set(dead)
        deadline = t0 + timeout
        first_failure_at = t0 if dead else None
        while pending:
            now = time.monotonic()
            limit = deadline if first_failure_at is None else min(deadline, first_failure_at + grace)
            if now >= limit:
                break
            waitables = {}
            for r in pending:
                waitables[self.conns[r]] = r
                waitables[self.procs[r].sentinel] = r
            ready = _mp_wait(list(waitables), timeout=limit - now)
            for obj in ready:
                r = waitables[obj]
                if r not in pending:
                    continue
                conn = self.conns[r]
                msg = None
                eof = False
                try:
                    if conn.poll():
                        msg = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    eof = True
                except Exception:
                    errors[r] = "cannot unpickle the result:\n" + traceback.format_exc()
                    pending.discard(r)
                    continue
                if msg is None:
                    if not eof and obj is conn and self.procs[r].is_alive():
                        continue  # spurious wake-up
                    self.procs[r].join(2.0)
                    dead[r] = _signame(self.procs[r].exitcode)
                    pending.discard(r)
                    continue
                tag, mseq, payload = msg
                if mseq != seq:
                    continue  # stale answer (cannot happen: pools die on failure)
                pending.discard(r)
                if tag == "ok":
                    results[r] = payload
                else:
                    errors[r] = payload
            if (errors or dead) and first_failure_at is None:
                first_failure_at = time.monotonic()
        elapsed = time.monotonic() - t0
        if not (errors or dead or pending):
            return [results[r] for r in range(self.n)]

        # ---- failure: collect evidence, kill the pool, raise
        hung = sorted(pending)
        for r in hung:  # ask faulthandler for the Python stacks of the hung ranks
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        if hung:
            time.sleep(1.0)
        native = _native_stacks({r: self.procs[r].pid for r in hung}) if hung else {}
        lines = [
            f"{'start-up of the pool' if startup else 'case ' + what} FAILED after "
            f"{elapsed:.1f}s [{self.spec.describe()}; bound {timeout:g}s, grace {grace:g}s]"
        ]
        summary = []
        if errors:
            summary.append(f"raised on rank(s) {sorted(errors)}")
        if dead:
            summary.append(f"died: rank(s) {sorted(dead)}")
        if hung:
            how = "within the bound" if first_failure_at is None else "within the grace"
            summary.append(f"HUNG (no answer {how}): rank(s) {hung}")
        if results:
            summary.append(f"answered: rank(s) {sorted(results)}")
        lines.append("  " + "; ".join(summary))
        offsets = getattr(self, "_offsets", None) if not startup else None
        for r in range(self.n):
            if r in results:
                continue
            off = offsets[r] if offsets else 0
            if r in errors:
                lines.append(f"--- rank {r}: raised:")
                lines.append(_indent(errors[r]))
                log = self._log_since(r, off)
                log = "\n".join(l for l in log.splitlines() if not l.startswith("----- case #"))
                if log.strip():
                    lines.append(f"--- rank {r}: output during the case:")
                    lines.append(_indent(log))
            elif r in dead:
                lines.append(f"--- rank {r}: DIED ({dead[r]}); its output:")
                # A crash's native stacks (every thread's, before faulthandler's) run long.
                lines.append(_indent(self._log_since(r, off, _CRASH_TAIL) or "(none)"))
            else:
                lines.append(f"--- rank {r}: HUNG; output and stack (faulthandler) :")
                lines.append(_indent(self._log_since(r, off) or "(none)"))
                lines.append(f"--- rank {r}: native stacks (gdb):")
                lines.append(_indent(native[r]))
        self.kill()
        cls = StartupFailure if startup else CaseFailure
        raise cls("\n".join(lines))


# --------------------------------------------------------------------------------------
# registry of pools

_POOLS: "collections.OrderedDict[PoolSpec, Pool]" = collections.OrderedDict()
_START_FAILURES: Dict[PoolSpec, List[str]] = {}
_LOCK = threading.Lock()
STATS = {"pools_started": 0, "workers_started": 0, "startup_seconds": 0.0,
         "pools_killed_on_failure": 0}


def _forget(pool: Pool) -> None:
    if _POOLS.get(pool.spec) is pool:
        del _POOLS[pool.spec]


def get_pool(backend: str, world_size: int, env: Optional[dict] = None, init: str = "file",
             options: Optional[dict] = None) -> Pool:
    """The cached live pool for this spec; starts one if needed."""
    __tracebackhide__ = True
    spec = make_spec(backend, world_size, env, init, options)
    pool = _POOLS.get(spec)
    if pool is not None and pool.alive:
        _POOLS.move_to_end(spec)
        return pool
    fails = _START_FAILURES.get(spec, [])
    if len(fails) >= 2:  # deterministic start-up failure (e.g. backend not importable)
        raise StartupFailure(f"[not retried: this pool failed to start {len(fails)} times "
                             f"earlier in the session]\n{fails[-1]}")
    while _POOLS and sum(p.n for p in _POOLS.values()) + world_size > MAX_WORKERS:
        _, old = _POOLS.popitem(last=False)
        old.shutdown(timeout=2.0)
    pool = Pool(spec)
    t0 = time.monotonic()
    try:
        pool.start()
    except StartupFailure as e:
        _START_FAILURES.setdefault(spec, []).append(str(e))
        raise
    finally:
        STATS["startup_seconds"] += time.monotonic() - t0
    STATS["pools_started"] += 1
    STATS["workers_started"] += world_size
    _START_FAILURES.pop(spec, None)
    _POOLS[spec] = pool
    return pool


def discard_pool(backend: str, world_size: int, env: Optional[dict] = None, init: str = "file",
                 options: Optional[dict] = None) -> None:
    """Kill the cached pool for this spec, if any: for a case whose ranks all answered but whose
    group may be out of step (a collective left half done), so that the next test starts afresh."""
    pool = _POOLS.get(make_spec(backend, world_size, env, init, options))
    if pool is not None:
        pool.kill()


def run(backend: str, world_size: int, fn: Callable, *args, env: Optional[dict] = None,
        init: str = "file", options: Optional[dict] = None, timeout: Optional[float] = None,
        grace: Optional[float] = None, **kwargs) -> List[Any]:
    """Run a case on the cached pool for (backend, world_size, env, init, options)."""
    __tracebackhide__ = True
    pool = get_pool(backend, world_size, env=env, init=init, options=options)
    try:
        return pool.run(fn, *args, timeout=timeout, grace=grace, **kwargs)
    except CaseFailure:
        STATS["pools_killed_on_failure"] += 1
        raise


def run_job(backend: str, world_size: int, fn: Callable, *args, env: Optional[dict] = None,
            init: str = "none", options: Optional[dict] = None,
            timeout: Optional[float] = None, **kwargs) -> List[Any]:
    """Run one case on a fresh, throw-away set of processes (default: no process group is
    initialised; the case does it, using ctx.rdv / ctx.init_process_group)."""
    __tracebackhide__ = True
    pool = Pool(make_spec(backend, world_size, env, init, options))
    try:
        pool.start()
        STATS["workers_started"] += world_size
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        if pool.alive:
            pool.shutdown(timeout=5.0)


def shutdown_all() -> None:
    pools = list(_POOLS.values())
    for p in pools:  # ask everybody first, then wait
        if p.alive:
            for c in p.conns:
                try:
                    c.send_bytes(pickle.dumps(None))
                except Exception:
                    pass
    deadline = time.monotonic() + 5.0
    for p in pools:
        for proc in p.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        p.kill()
    _POOLS.clear()


atexit.register(shutdown_all)
