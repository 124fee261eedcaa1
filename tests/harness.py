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
workers' Python stacks are dumped (faulthandler on SIGUSR1), the whole pool is SIGKILLed
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

import atexit
import collections
import dataclasses
import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import multiprocessing as mp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


#: default bound of one case, seconds (per call: ``timeout=``)
DEFAULT_TIMEOUT = _env_float("TORUS_TEST_TIMEOUT", 60.0)
#: bound for starting a pool (spawn + import torch + init_process_group on every rank)
STARTUP_TIMEOUT = _env_float("TORUS_TEST_STARTUP_TIMEOUT", 180.0)
#: once one rank failed, how long the others may still take to answer
DEFAULT_GRACE = _env_float("TORUS_TEST_GRACE", 5.0)
#: the process group's own timeout; larger than the case bound so the harness decides
PG_TIMEOUT = _env_float("TORUS_TEST_PG_TIMEOUT", 300.0)
#: live workers kept across all cached pools (LRU eviction beyond that)
MAX_WORKERS = int(_env_float("TORUS_TEST_MAX_WORKERS", 40))
#: modules to import in the workers (before init) so that a backend name is registered
BACKEND_MODULES = {"torus": "torch_torus"}
_LOG_TAIL = 4000


class CaseFailure(AssertionError):
    """A case failed on at least one rank (raised, died or hung)."""


class StartupFailure(CaseFailure):
    """A pool could not be started (spawn, import or init_process_group failed)."""


# --------------------------------------------------------------------------------------
# specification of a pool


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    backend: str
    world_size: int
    env: Tuple[Tuple[str, str], ...] = ()
    #: "file" (FileStore via file://), "tcp" (tcp://), "env" (env://),
    #: "store" (explicit TCPStore passed as store=), "none" (the case initialises)
    init: str = "file"
    #: kwargs for torch_torus.Options (pg_options); ignored for other backends
    options: Tuple[Tuple[str, Any], ...] = ()

    def describe(self) -> str:
        s = f"backend={self.backend} world_size={self.world_size} init={self.init}"
        if self.env:
            s += " env={" + ", ".join(f"{k}={v}" for k, v in self.env) + "}"
        if self.options:
            s += " options={" + ", ".join(f"{k}={v!r}" for k, v in self.options) + "}"
        return s


def without_ofi() -> Optional[str]:
    """Why the OFI transport cannot be tested here (a build without libfabric), or None."""
    import torch_torus

    if torch_torus._C.built_with_ofi:
        return None
    return ("torch_torus was built without libfabric (apt install libfabric-dev, then reinstall): "
            "the ofi transport is not tested")


def split_backend(backend: str) -> Tuple[str, Dict[str, str]]:
    """"torus+tcp" -> ("torus", {"TORUS_TRANSPORT": "tcp"}): a backend and the transport its
    tests run over; a plain name has no transport setting."""
    name, _, transport = backend.partition("+")
    return name, ({"TORUS_TRANSPORT": transport} if transport else {})


def make_spec(backend, world_size, env=None, init="file", options=None) -> PoolSpec:
    backend, transport_env = split_backend(backend)
    env = {**transport_env, **(env or {})}
    env_t = tuple(sorted((str(k), str(v)) for k, v in env.items()))
    opt_t = tuple(sorted((options or {}).items()))
    if init not in ("file", "tcp", "env", "store", "none"):
        raise ValueError(f"unknown init {init!r}")
    return PoolSpec(backend, int(world_size), env_t, init, opt_t)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------
# worker side


class WorkerContext:
    """What a case gets as its first argument (lives in the worker process)."""

    def __init__(self, rank: int, spec: PoolSpec, rdv: Dict[str, Any], scratch: str):
        self.rank = rank
        self.world_size = spec.world_size
        self.backend = spec.backend
        self.spec = spec
        self.env = dict(spec.env)
        self.options = dict(spec.options)
        self.rdv = rdv  # rendezvous info chosen by the parent: file path, port
        self.scratch = scratch  # a directory shared by all ranks of this pool
        self.state: Dict[str, Any] = {}  # survives between cases of the same pool

    # helpers usable from cases -------------------------------------------------------
    def import_backend(self, backend: Optional[str] = None) -> None:
        """Import the module that registers a backend ("torus", "cpu:torus", ...)."""
        for part in (backend or self.backend).split(","):
            name = BACKEND_MODULES.get(part.split(":")[-1].strip())
            if name:
                importlib.import_module(name)

    def pg_options(self, **overrides):
        """pg_options for the backend under test (torch_torus.Options), or None. A string value
        may name this rank as ``{rank}`` (``host_id="host-{rank}"``: every rank its own host) and
        its pair as ``{rank_pair}`` (rank // 2: two ranks to a host)."""
        kw = {k: v.format(rank=self.rank, rank_pair=self.rank // 2) if isinstance(v, str) else v
              for k, v in self.options.items()}
        kw.update(overrides)
        if not kw or self.backend != "torus":
            return None
        import torch_torus

        return torch_torus.Options(**kw)

    def init_process_group(self, init: Optional[str] = None, backend: Optional[str] = None,
                           tag: str = "", port: Optional[int] = None, **kwargs) -> None:
        """init_process_group the way this pool's spec says (or ``init``): "file" (FileStore
        at rdv["file"] + tag), "tcp", "env", "store" (TCPStore on ``port``, default
        rdv["port"]; rdv["ports"] has spare ones for re-initialisation)."""
        import datetime

        import torch.distributed as dist

        backend = backend or self.backend
        init = init or self.spec.init
        self.import_backend(backend)
        kwargs.setdefault("timeout", datetime.timedelta(seconds=PG_TIMEOUT))
        if backend == self.backend and "pg_options" not in kwargs:
            opts = self.pg_options()
            if opts is not None:
                kwargs["pg_options"] = opts
        ws, rank = self.world_size, self.rank
        port = port or self.rdv["port"]
        if init == "file":
            path = self.rdv["file"] + tag
            dist.init_process_group(backend, init_method="file://" + path, rank=rank,
                                    world_size=ws, **kwargs)
        elif init == "tcp":
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=ws, **kwargs)
        elif init == "env":
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              RANK=str(rank), WORLD_SIZE=str(ws))
            dist.init_process_group(backend, init_method="env://", **kwargs)
        elif init == "store":
            store = dist.TCPStore("127.0.0.1", port, ws, is_master=(rank == 0),
                                  timeout=kwargs["timeout"], wait_for_workers=True)
            dist.init_process_group(backend, store=store, rank=rank, world_size=ws, **kwargs)
        else:
            raise ValueError(f"init={init!r}")

    def new_group(self, ranks=None, backend: Optional[str] = None, **kwargs):
        """dist.new_group with the backend under test (and its pg_options)."""
        import torch.distributed as dist

        backend = backend or self.backend
        if "pg_options" not in kwargs and backend == self.backend:
            opts = self.pg_options()
            if opts is not None:
                kwargs["pg_options"] = opts
        return dist.new_group(ranks=ranks, backend=backend, **kwargs)


def _resolve(ref):
    module_name, qualname, path = ref
    mod = sys.modules.get(module_name)
    if mod is None:
        try:
            mod = importlib.import_module(module_name)
        except ImportError:
            if not path:
                raise
            spec = importlib.util.spec_from_file_location(module_name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = mod
            spec.loader.exec_module(mod)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _orphan_watchdog(parent_pid: int) -> None:
    # if pytest dies (even by SIGKILL) the workers must not linger
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(70)


def _send(conn, obj) -> None:
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an unpicklable result must not kill the worker
        tag, seq, _ = obj
        data = pickle.dumps(("err", seq, "result is not picklable:\n" + traceback.format_exc()))
    conn.send_bytes(data)


def _worker_main(rank: int, spec: PoolSpec, conn, log_path: str, parent_pid: int,
                 rdv: Dict[str, Any], scratch: str) -> None:
    try:
        os.setpgid(0, 0)  # own process group: the parent kills it with killpg
    except OSError:
        pass
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
    except Exception:
        pass
    os.environ.update(dict(spec.env))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    threading.Thread(target=_orphan_watchdog, args=(parent_pid,), daemon=True).start()

    ctx = WorkerContext(rank, spec, rdv, scratch)
    try:
        import torch

        torch.set_num_threads(1)
        if spec.init != "none":
            ctx.init_process_group()
        _send(conn, ("ok", 0, os.getpid()))
    except BaseException:
        _send(conn, ("err", 0, traceback.format_exc()))
        sys.stderr.flush()
        os._exit(3)

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        seq = -1
        try:
            msg = pickle.loads(data)
            if msg is None:
                break
            seq, ref, args, kwargs = msg
            print(f"----- case #{seq} {ref[0]}.{ref[1]} -----", flush=True)
            fn = _resolve(ref)
            reply = ("ok", seq, fn(ctx, *args, **kwargs))
        except BaseException:
            reply = ("err", seq, traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            _send(conn, reply)
        except (BrokenPipeError, OSError):
            break
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------
# parent side


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

    def _log_since(self, r: int, offset: int) -> str:
        try:
            with open(self.logs[r], "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        if len(text) > _LOG_TAIL:
            text = "[...]\n" + text[-_LOG_TAIL:]
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
                lines.append(_indent(self._log_since(r, off) or "(none)"))
            else:
                lines.append(f"--- rank {r}: HUNG; output and stack (faulthandler) :")
                lines.append(_indent(self._log_since(r, off) or "(none)"))
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
