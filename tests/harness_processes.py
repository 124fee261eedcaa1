"""The harness's processes: what a pool is made of (its spec, the bounds every case runs under) and
the worker side, which runs in each rank's process: it applies the spec's environment, initialises
the process group once, then runs the cases the parent sends (tests/harness.py explains the whole).

This module must not import torch at import time: workers apply their env first.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Dict, Optional, Tuple


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
        # A crash prints every thread's native stack (torch's handler, which then hands the signal
        # to faulthandler's): Python frames alone cannot say where a C++ thread faulted.
        torch._C._set_print_stack_traces_on_fatal_signal(True)
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
