"""Who the bench measures: contenders written as "name" or "name:key=value,key=value", several
joined by ';' or ','; the import of the backends they name; the mpi contender's communicator."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist

from .collectives import REDUCE_OPS, Buffers, Collective

# The contender that runs MPI's collectives through mpi4py, and the MPI names of the reduce ops
# it offers (MPI has no average).
MPI_CONTENDER = "mpi"
MPI_REDUCE_OPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX"}
# A torus contender's option read by the bench, not the backend: how the call is made. "dist" is
# torch.distributed; "op" is torch.ops.torus.all_reduce_ (no ProcessGroup dispatch, no Work;
# all_reduce of CPU tensors only), under the reduce op names it takes.
API_OPTION = "api"
APIS = ("dist", "op")
TORUS_OP_REDUCE_OPS = {"sum": "sum", "prod": "product", "min": "min", "max": "max", "avg": "avg"}


@dataclasses.dataclass
class Contender:
    backend: str
    options: dict[str, str]  # the user's text, for torch_torus.Options, the header and the JSON
    group: dist.ProcessGroup | None = None
    # torch_torus.algorithm_for(collective, nbytes, group) for torus contenders, when it exists.
    algorithm_for: Callable[[str, int, dist.ProcessGroup], str] | None = None
    # The mpi contender's communicator (a duplicate of MPI.COMM_WORLD), instead of a group.
    comm: object | None = None
    library: str | None = None  # the mpi contender's: "Open MPI v5.0.11, mpi4py 4.1.2"
    # A torus contender's group's: "tcp", "shm", "shm+tcp"; over ofi, with its provider.
    transport: str | None = None

    def bind(self, collective: Collective, buffers: Buffers, op: str) -> Callable[[], None]:
        """One call of `collective` on `buffers`, ready to repeat: through torch.distributed on
        the contender's group, or through mpi4py on numpy views of the same tensors."""
        if self.api == "op":
            tensor, group_name, reduce_op = buffers.output, self.group.group_name, TORUS_OP_REDUCE_OPS[op]
            all_reduce_ = torch.ops.torus.all_reduce_
            return lambda: all_reduce_(tensor, group_name, reduce_op)
        if self.comm is None:
            group, reduce_op = self.group, REDUCE_OPS[op]
            return lambda: collective.call(buffers, group, reduce_op)
        from mpi4py import MPI

        comm = self.comm
        mpi_op = getattr(MPI, MPI_REDUCE_OPS[op]) if collective.has_op else None
        # An in-place collective passes MPI.IN_PLACE as its input, as torch's call passes one
        # tensor for both.
        in_place = buffers.input is buffers.output
        input = MPI.IN_PLACE if in_place else buffers.input.numpy()
        output = buffers.output.numpy()
        return lambda: collective.call_mpi(input, output, comm, mpi_op)

    def barrier(self) -> None:
        """The contender's own barrier (OSU's MPI_Barrier on the communicator it measures): its
        group's, or MPI's on its communicator."""
        if self.comm is not None:
            self.comm.Barrier()
        else:
            dist.barrier(group=self.group)

    @property
    def api(self) -> str:
        """How calls are made: "dist" (torch.distributed) or "op" (torch.ops.torus)."""
        return self.options.get(API_OPTION, "dist")

    @property
    def label(self) -> str:
        """The contender as it would be written: "torus:allreduce=ring,chunk_bytes=1M"."""
        if not self.options:
            return self.backend
        return self.backend + ":" + ",".join(f"{key}={value}" for key, value in self.options.items())

    @property
    def legend(self) -> str:
        """The label, and for the mpi contender its library: "mpi (Open MPI v5.0.11, ...)"."""
        return f"{self.label} ({self.library})" if self.library else self.label

    def algorithm(self, collective: str, nbytes: int) -> str | None:
        """The algorithm the backend picks for such a call, if it can say."""
        return str(self.algorithm_for(collective, nbytes, self.group)) if self.algorithm_for else None

    def pg_options(self):
        """Options object for dist.new_group, or None to take the backend's defaults."""
        if not self.options:
            return None
        import torch_torus

        # Passed as written: torch_torus parses them as it parses the TORUS_* variables, and
        # its errors then quote what the user typed.
        backend_options = {key: value for key, value in self.options.items() if key != API_OPTION}
        return torch_torus.Options(**backend_options) if backend_options else None


CONTENDER_START = re.compile(r"^(\w+)(?::(\w+=.*))?$")  # "gloo", "torus:allreduce=ring"
OPTION = re.compile(r"^(\w+)=(.*)$")


def parse_contenders(specs: list[str]) -> list[Contender]:
    """Parse --backends values into contenders.

    Pieces are separated by ',' or ';'. A piece that is a bare name, or name:key=value, starts a
    contender; key=value adds an option to the current one; a piece after ';' that is neither
    (like "ring:1048577-max") continues the previous option's value, so that oneCCL-style rules
    "recursive_doubling:0-8192;ring:8193-max" pass through whole.
    """
    contenders: list[Contender] = []
    last_key = None  # the option that a rule block after ';' continues
    for spec in specs:
        for separator, piece in re.findall(r"(^|[,;])([^,;]*)", spec):
            piece = piece.strip()
            if not piece:
                continue
            start = CONTENDER_START.match(piece)
            if start:
                name, first_option = start.groups()
                contenders.append(Contender(backend=name.lower(), options={}))
                last_key = None
                if first_option is None:
                    continue
                piece = first_option
            option = OPTION.match(piece)
            if option:
                if not contenders:
                    raise ValueError(f"option {piece!r} comes before any backend in {spec!r}")
                last_key = option.group(1).lower()
                contenders[-1].options[last_key] = option.group(2).strip()
            elif separator == ";" and last_key is not None:
                contenders[-1].options[last_key] += ";" + piece
            else:
                raise ValueError(f"cannot read {piece!r} in {spec!r}")
    for contender in contenders:
        if contender.options and contender.backend != "torus":
            raise ValueError(
                f"options are understood for the torus backend only, not {contender.backend!r}")
        if contender.api not in APIS:
            raise ValueError(f"{contender.label}: {API_OPTION}={contender.api!r} is not one of "
                             f"{', '.join(APIS)}")
    labels = Counter(contender.label for contender in contenders)
    repeated = [label for label, times in labels.items() if times > 1]
    if repeated:
        raise ValueError(f"contender listed twice: {', '.join(repeated)}")
    if not contenders:
        raise ValueError("no backend to measure")
    return contenders


def import_backends(contenders: list[Contender], modules: list[str]) -> None:
    """Import what registers the contenders' backends; torch_torus only if "torus" is asked for."""
    for module in modules:
        importlib.import_module(module)
    lookup = None
    if any(contender.backend == "torus" for contender in contenders):
        try:
            import torch_torus
        except ImportError as error:
            raise SystemExit(
                f"backend 'torus' needs the torch_torus package, which does not import ({error}).\n"
                "To measure other backends only, name them, e.g. --backends gloo") from error
        lookup = getattr(torch_torus, "algorithm_for", None)
    for contender in contenders:
        if contender.backend == MPI_CONTENDER:
            continue  # not a torch backend: set up by start_mpi_contender
        if contender.backend not in dist.Backend.backend_list:
            raise SystemExit(
                f"backend {contender.backend!r} is not registered with torch.distributed "
                f"(registered: {', '.join(dist.Backend.backend_list)}); "
                "--import-module names a module that registers one")
        if contender.backend == "torus" and lookup is not None:
            contender.algorithm_for = lookup


MPI_LAUNCH_EXAMPLE = "mpiexec -n 4 python -m torch_torus.bench --backends 'torus;gloo;mpi'"


def init_env_under_mpiexec(contenders: list[Contender]):
    """Under mpiexec or srun, derive torch's env:// variables from the launcher's; under
    torchrun they are set. Returns the MPI launch (a torch_torus.launch.MpiLaunch), or None
    without one. The mpi contender needs mpiexec: under torchrun each process would be an MPI
    world of its own."""
    wants_mpi = any(contender.backend == MPI_CONTENDER for contender in contenders)
    if "RANK" in os.environ and not wants_mpi:
        return None  # torchrun or another env:// launcher
    from torch_torus.launch import (LaunchError, init_env_from_mpi, init_env_from_slurm,
                                    mpi_launch_from_env, slurm_launch_from_env)

    try:
        launch = mpi_launch_from_env()
        if launch is not None and "RANK" not in os.environ:
            init_env_from_mpi()
        elif launch is None and "RANK" not in os.environ and slurm_launch_from_env() is not None:
            init_env_from_slurm()
    except LaunchError as error:
        raise SystemExit(f"torch_torus.bench: {error}") from error
    if launch is None and wants_mpi:
        raise SystemExit(
            f"the {MPI_CONTENDER!r} contender calls MPI through mpi4py, so the job must be "
            f"started by mpiexec (MPICH or Open MPI), not torchrun, e.g.\n  {MPI_LAUNCH_EXAMPLE}\n"
            "(see docs/benchmarks.md, 'MPI as a contender')")
    return launch


def start_mpi_contender(contender: Contender, launch) -> None:
    """Give the mpi contender its own communicator, so its traffic meets no other."""
    from torch_torus.launch import INSTALL_HINT, MpiLaunchError, check_comm_matches

    try:
        import mpi4py
        from mpi4py import MPI
    except ImportError as error:
        raise SystemExit(f"the {MPI_CONTENDER!r} contender needs mpi4py, which does not import "
                         f"({error}): {INSTALL_HINT}") from error
    try:
        check_comm_matches(launch, MPI.COMM_WORLD)
    except MpiLaunchError as error:
        raise SystemExit(f"torch_torus.bench: {error}") from error
    contender.comm = MPI.COMM_WORLD.Dup()
    # The first line up to its first comma names the library and version in MPICH and Open MPI.
    library = " ".join(MPI.Get_library_version().splitlines()[0].split(",")[0].split())
    contender.library = f"{library}, mpi4py {mpi4py.__version__}"
