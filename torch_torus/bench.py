"""Benchmark torch.distributed collectives with nccl-tests' columns, several backends side by side.

    torchrun --nproc-per-node 4 -m torch_torus.bench -b 4K -e 64M -f 2 --check \\
        --backends "torus:allreduce=ring,chunk_bytes=1M;torus:allreduce=torus;gloo"

Every contender (a backend, optionally with torus options) gets its own process group, created
with dist.new_group after a gloo bootstrap group. The contender "mpi" is not a torch backend: it
calls MPI's collectives through mpi4py on numpy views of the same tensors (in place where torch's
call is), timed the same way, so that torus, gloo and MPI compare in one run:

    mpiexec -n 4 python -m torch_torus.bench --backends "torus;gloo;mpi"

Sizes are measured one after another and, at each size, every contender in turn, so drift of the
machine over a long run hits all contenders alike and the ratios printed at the end compare like
with like.

Columns follow nccl-tests (all_reduce_perf and friends):
  size   bytes of the largest buffer one rank passes (for allgather the gathered output,
         for reduce_scatter and alltoall the whole input)
  count  the element count the collective is called with: the whole tensor for allreduce and
         broadcast, one rank's share for allgather, reduce_scatter and alltoall
  time   mean time of one call over --iters calls, the slowest rank's
  algbw  size / time;  busbw = algbw x the collective's bus factor: 2(n-1)/n for allreduce,
         (n-1)/n for allgather, reduce_scatter and alltoall, 1 for broadcast
  #wrong elements that differ from the expected result, summed over ranks (--check)

The script runs under torchrun or any launcher that sets the env:// variables (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE), and under mpiexec (MPICH or Open MPI) and Slurm's srun, from
whose variables torch_torus.launch derives them; both as `-m torch_torus.bench` and as a plain
script path.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import random
import re
import socket
import sys
import time
from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
}
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}
# The exact reduction of one element's values over all ranks, for --check.
REDUCE_EXACTLY: dict[str, Callable[[list[int]], float]] = {
    "sum": sum,
    "prod": math.prod,
    "min": min,
    "max": max,
    "avg": lambda values: sum(values) / len(values),
}

# The contender that runs MPI's collectives through mpi4py, and the MPI names of the reduce ops
# it offers (MPI has no average).
MPI_CONTENDER = "mpi"
MPI_REDUCE_OPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX"}

SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)
SIZE_MULTIPLIERS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}

# The values 1..127 repeat along every --check input. Integers up to 127 are exact in every dtype
# offered (int8 included), and 127 is prime: a chunk or block that lands at a wrong offset, a
# power of two or a rank's share away, does not meet the same values there.
CHECK_VALUES = list(range(1, 128))


def parse_size(text: str) -> int:
    """'4096', '4K', '64M', '1G', '1MiB' -> bytes (K = 1024, as nccl-tests)."""
    match = SIZE_PATTERN.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (expected e.g. 4096, 4K, 64M, 1G)")
    return int(match.group(1)) * SIZE_MULTIPLIERS[match.group(2).lower()]


# --------------------------------------------------------------------------------------------
# Contenders: "name" or "name:key=value,key=value", several joined by ';' or ','.


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
    transport: str | None = None  # a torus contender's group's: "tcp", "shm" or "shm+tcp"

    def bind(self, collective: Collective, buffers: Buffers, op: str) -> Callable[[], None]:
        """One call of `collective` on `buffers`, ready to repeat: through torch.distributed on
        the contender's group, or through mpi4py on numpy views of the same tensors."""
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
        return torch_torus.Options(**self.options)


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
            "(see README.md, 'MPI as a contender')")
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


# --------------------------------------------------------------------------------------------
# Collectives: buffers, the call, and the expected result for --check.


def periodic(values: list, start: int, count: int) -> torch.Tensor:
    """Tensor whose element j is values[(start + j) % len(values)], exact (int64 or float64)."""
    exact_dtype = torch.int64 if all(isinstance(value, int) for value in values) else torch.float64
    period = len(values)
    one_period = torch.tensor(values, dtype=exact_dtype).roll(-(start % period))
    return one_period.repeat(-(-count // period))[:count]


@dataclasses.dataclass
class CheckPattern:
    """Inputs and expected outputs that every rank can compute locally.

    Rank r's input element at index i is base[(i + r) % len(base)], so the reduction over all
    ranks of index i depends only on i % len(base): reduced[i % len(base)].
    """

    base: list
    reduced: list

    @classmethod
    def make(cls, op: str, world_size: int) -> CheckPattern:
        # A product of 1..127 over a few ranks overflows every dtype; instead one rank in world_size
        # contributes a 2 at each index and the rest 1, so every result element is exactly 2.
        base = [2] + [1] * (world_size - 1) if op == "prod" else CHECK_VALUES
        period = len(base)
        reduced = [REDUCE_EXACTLY[op]([base[(s + r) % period] for r in range(world_size)])
                   for s in range(period)]
        return cls(base, reduced)

    def input_of(self, rank: int, count: int, start: int = 0) -> torch.Tensor:
        """Elements start .. start+count-1 of rank's input."""
        return periodic(self.base, start + rank, count)


@dataclasses.dataclass
class Buffers:
    input: torch.Tensor
    output: torch.Tensor  # the same tensor as input for in-place collectives


class Collective:
    """One collective: how big its buffers are, how to call it, what it must produce.

    `count` is the element count the collective is called with, as nccl-tests' count column.
    """

    name: str
    bus_factor_doc: str
    has_op = False
    has_root = False

    def __init__(self, world_size: int, rank: int, root: int):
        self.world_size, self.rank, self.root = world_size, rank, root

    def count_for(self, size_bytes: int, itemsize: int) -> int:
        return max(1, size_bytes // itemsize)

    def size_bytes(self, count: int, itemsize: int) -> int:
        return count * itemsize

    def bus_factor(self) -> float:
        raise NotImplementedError

    def allocate(self, count: int, dtype: torch.dtype, device: torch.device) -> Buffers:
        tensor = torch.empty(count, dtype=dtype, device=device)
        return Buffers(tensor, tensor)

    def call(self, buffers: Buffers, group: dist.ProcessGroup, op) -> None:
        raise NotImplementedError

    def call_mpi(self, input, output, comm, op) -> None:
        """The same collective through mpi4py: `input` and `output` are numpy views of the
        buffers (`input` is MPI.IN_PLACE for in-place collectives), `op` an MPI.Op or None."""
        raise NotImplementedError

    def fill(self, buffers: Buffers, pattern: CheckPattern) -> None:
        """Reset the input to this rank's pattern and clear a separate output, so that a check
        cannot pass on values left over from the timed calls."""
        if buffers.output is not buffers.input:
            buffers.output.zero_()
        buffers.input.copy_(pattern.input_of(self.rank, buffers.input.numel()))

    def expected(self, count: int, pattern: CheckPattern) -> torch.Tensor:
        raise NotImplementedError


class AllReduce(Collective):
    name, bus_factor_doc, has_op = "allreduce", "2(n-1)/n", True

    def bus_factor(self):
        return 2 * (self.world_size - 1) / self.world_size

    def call(self, buffers, group, op):
        dist.all_reduce(buffers.input, op=op, group=group)

    def call_mpi(self, input, output, comm, op):
        comm.Allreduce(input, output, op)

    def expected(self, count, pattern):
        return periodic(pattern.reduced, 0, count)


class Broadcast(Collective):
    name, bus_factor_doc, has_root = "broadcast", "1", True

    def bus_factor(self):
        return 1.0

    def call(self, buffers, group, op):
        dist.broadcast(buffers.input, group_src=self.root, group=group)

    def call_mpi(self, input, output, comm, op):
        comm.Bcast(output, root=self.root)

    def fill(self, buffers, pattern):
        # Non-roots start from zeros: the pattern is never 0, so a missed element shows.
        if self.rank == self.root:
            super().fill(buffers, pattern)
        else:
            buffers.input.zero_()

    def expected(self, count, pattern):
        return pattern.input_of(self.root, count)


class ShardedCollective(Collective):
    """Collectives whose count is one rank's share of a buffer of world_size shares."""

    bus_factor_doc = "(n-1)/n"

    def count_for(self, size_bytes, itemsize):
        return max(1, size_bytes // (itemsize * self.world_size))

    def size_bytes(self, count, itemsize):
        return count * itemsize * self.world_size

    def bus_factor(self):
        return (self.world_size - 1) / self.world_size

    def buffer_lengths(self, count: int) -> tuple[int, int]:
        """Elements of the input and of the output."""
        raise NotImplementedError

    def allocate(self, count, dtype, device):
        input_length, output_length = self.buffer_lengths(count)
        return Buffers(torch.empty(input_length, dtype=dtype, device=device),
                       torch.empty(output_length, dtype=dtype, device=device))


class AllGather(ShardedCollective):
    name = "allgather"

    def buffer_lengths(self, count):
        return count, count * self.world_size

    def call(self, buffers, group, op):
        dist.all_gather_single(buffers.output, buffers.input, group=group)

    def call_mpi(self, input, output, comm, op):
        comm.Allgather(input, output)

    def expected(self, count, pattern):
        return torch.cat([pattern.input_of(rank, count) for rank in range(self.world_size)])


class ReduceScatter(ShardedCollective):
    name, has_op = "reduce_scatter", True

    def buffer_lengths(self, count):
        return count * self.world_size, count

    def call(self, buffers, group, op):
        dist.reduce_scatter_single(buffers.output, buffers.input, op=op, group=group)

    def call_mpi(self, input, output, comm, op):
        comm.Reduce_scatter_block(input, output, op)

    def expected(self, count, pattern):
        return periodic(pattern.reduced, self.rank * count, count)


class AllToAll(ShardedCollective):
    name = "alltoall"

    def buffer_lengths(self, count):
        return count * self.world_size, count * self.world_size

    def call(self, buffers, group, op):
        dist.all_to_all_single(buffers.output, buffers.input, group=group)

    def call_mpi(self, input, output, comm, op):
        comm.Alltoall(input, output)

    def expected(self, count, pattern):
        # Block r of our output is block `self.rank` of rank r's input.
        return torch.cat([pattern.input_of(rank, count, start=self.rank * count)
                          for rank in range(self.world_size)])


COLLECTIVES = {cls.name: cls for cls in (AllReduce, AllGather, ReduceScatter, Broadcast, AllToAll)}


def count_wrong(actual: torch.Tensor, exact: torch.Tensor, world_size: int) -> int:
    """Elements of `actual` that differ from `exact`: exactly for integers (which wrap around as
    the backend's do); for floats beyond the rounding that adding world_size values in another
    order may bring."""
    actual = actual.cpu()
    if not actual.is_floating_point():
        return int((actual != exact.to(actual.dtype)).sum())
    tolerance = torch.finfo(actual.dtype).eps * world_size
    exact = exact.to(torch.float64)
    return int(((actual.to(torch.float64) - exact).abs() > tolerance * exact.abs()).sum())


# --------------------------------------------------------------------------------------------
# Measuring


@dataclasses.dataclass
class Row:
    """One contender at one size, as reported: times are the slowest rank's."""

    contender: Contender
    size_bytes: int
    count: int
    time_us: float
    algbw: float  # GB/s, 1e9 bytes
    busbw: float
    wrong: int | None  # None when not checked
    algorithm: str | None

    def to_json(self) -> dict:
        return {
            "contender": self.contender.label,
            "backend": self.contender.backend,
            "options": self.contender.options,
            "size_bytes": self.size_bytes,
            "count": self.count,
            "time_us": self.time_us,
            "algbw_gbps": self.algbw,
            "busbw_gbps": self.busbw,
            "wrong": self.wrong,
            "algorithm": self.algorithm,
        }


def time_contender(collective: Collective, buffers: Buffers, call: Callable[[], None], calls: int,
                   pattern: CheckPattern, args: argparse.Namespace, bootstrap: dist.ProcessGroup,
                   synchronize: Callable[[], None]) -> float:
    """Mean seconds per call over `calls` calls on this rank. Every call is waited for before the
    next one is issued: that is the latency a caller sees, and it keeps calls from racing on one
    buffer."""
    # Each contender starts from the same data: an in-place allreduce repeated grows its values.
    collective.fill(buffers, pattern)
    for _ in range(args.warmup):
        call()
    synchronize()
    dist.barrier(group=bootstrap)
    start = time.perf_counter()
    for _ in range(calls):
        call()
        synchronize()
    return (time.perf_counter() - start) / calls


def check_contender(collective: Collective, buffers: Buffers, count: int, call: Callable[[], None],
                    pattern: CheckPattern, synchronize: Callable[[], None]) -> int:
    """One call on freshly filled buffers; returns this rank's wrong elements."""
    collective.fill(buffers, pattern)
    call()
    synchronize()
    return count_wrong(buffers.output, collective.expected(count, pattern), collective.world_size)


def round_order(count: int, round_index: int) -> list[int]:
    """The order to time `count` contenders in, in round `round_index`: as listed first, then a new
    order each round, the same on every rank (seeded by the round). What one contender leaves
    behind (gloo's slow small calls on a shaped link, say) then falls on a different one each time."""
    order = list(range(count))
    if round_index:
        random.Random(round_index).shuffle(order)
    return order


def calls_per_round(first_round: list[float], iters: int, min_round_ms: float) -> list[int]:
    """Calls per round for each contender after the first round (its seconds per call there, the
    same on every rank): enough to last `min_round_ms`, up to 100x `iters`. A round of a few small
    calls is mostly the wake-ups after the barrier that starts it; more calls average them out."""
    return [min(100 * iters, max(iters, math.ceil(min_round_ms / 1e3 / max(t, 1e-9)))) for t in first_round]


def measure_size(count: int, collective: Collective, args: argparse.Namespace,
                 pattern: CheckPattern, bootstrap: dist.ProcessGroup, device: torch.device,
                 synchronize: Callable[[], None]) -> list[Row]:
    contenders = args.contenders
    dtype = DTYPES[args.dtype]
    size_bytes = collective.size_bytes(count, dtype.itemsize)
    buffers = collective.allocate(count, dtype, device)  # shared by all contenders at this size

    calls = [contender.bind(collective, buffers, args.op) for contender in contenders]
    seconds = [[0.0] * len(calls) for _ in range(args.rounds)]
    round_calls = [args.iters] * len(calls)  # timed calls per round, for each contender
    for round_index in range(args.rounds):
        for index in round_order(len(calls), round_index):
            seconds[round_index][index] = time_contender(collective, buffers, calls[index], round_calls[index],
                                                         pattern, args, bootstrap, synchronize)
        if round_index == 0 and args.rounds > 1 and args.min_round_ms > 0:
            first = torch.tensor(seconds[0], dtype=torch.float64)
            dist.all_reduce(first, op=dist.ReduceOp.MAX, group=bootstrap)
            round_calls = calls_per_round(first.tolist(), args.iters, args.min_round_ms)
    wrong = [check_contender(collective, buffers, count, call, pattern, synchronize)
             for call in calls] if args.check else []
    # The slowest rank sets a round's time, as in nccl-tests; the best round counts (other work
    # on the machine only ever adds time); wrong elements add up over ranks.
    per_round = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(per_round, op=dist.ReduceOp.MAX, group=bootstrap)
    seconds_tensor = per_round.min(dim=0).values
    if args.check:
        wrong_tensor = torch.tensor(wrong, dtype=torch.int64)
        dist.all_reduce(wrong_tensor, group=bootstrap)
        wrong = wrong_tensor.tolist()

    rows = []
    for index, contender in enumerate(contenders):
        time_s = seconds_tensor[index].item()
        algbw = size_bytes / time_s / 1e9
        rows.append(Row(
            contender=contender, size_bytes=size_bytes, count=count, time_us=time_s * 1e6,
            algbw=algbw, busbw=algbw * collective.bus_factor(),
            wrong=wrong[index] if args.check else None,
            algorithm=contender.algorithm(collective.name, size_bytes)))
    return rows


def counts_to_measure(collective: Collective, args: argparse.Namespace) -> list[int]:
    """Element counts for sizes min, min*factor, ... up to max bytes. Small sizes can round to
    the same count (a sharded collective needs a whole element per rank): each is kept once."""
    counts, size = [], args.min_bytes
    while size <= args.max_bytes:
        count = collective.count_for(size, DTYPES[args.dtype].itemsize)
        if count not in counts:
            counts.append(count)
        size *= args.factor
    return counts


# --------------------------------------------------------------------------------------------
# Report (rank 0)


class Table:
    """nccl-tests layout: common columns, then one group of columns per contender."""

    COMMON = "{:>12}  {:>12}  {:>8}  {:>6}  {:>5}"
    GROUP = "  {:>10}  {:>7}  {:>7}  {:>6}"
    ALGORITHM = "  {:>18}"

    def __init__(self, collective: Collective, args: argparse.Namespace):
        self.collective, self.contenders, self.args = collective, args.contenders, args

    def group_format(self, contender: Contender) -> str:
        return self.GROUP + (self.ALGORITHM if contender.algorithm_for else "")

    def header_lines(self) -> list[str]:
        common_width = len(self.COMMON.format(*[""] * 5))
        titles = " " * common_width
        names = self.COMMON.format("size", "count", "type", "redop", "root")
        units = self.COMMON.format("(B)", "(elements)", "", "", "")
        for index, contender in enumerate(self.contenders, 1):
            group = self.group_format(contender)
            width = len(group.format(*[""] * group.count("{")))
            title = f"[{index}] {contender.label}"
            if len(title) > width - 2:
                title = title[:width - 5] + "..."
            titles += "  " + title.ljust(width - 2)
            extra = ("algorithm",) if contender.algorithm_for else ()
            names += group.format("time", "algbw", "busbw", "#wrong", *extra)
            units += group.format("(us)", "(GB/s)", "(GB/s)", "", *("",) * len(extra))
        return ["#" + line[1:].rstrip() for line in (titles, names, units)]

    def row_line(self, rows: list[Row]) -> str:
        collective, first = self.collective, rows[0]
        line = self.COMMON.format(
            first.size_bytes, first.count, self.args.dtype,
            self.args.op if collective.has_op else "none",
            collective.root if collective.has_root else -1)
        for row in rows:
            values = [f"{row.time_us:.1f}", f"{row.algbw:.3f}", f"{row.busbw:.3f}",
                      "-" if row.wrong is None else str(row.wrong)]
            if row.contender.algorithm_for:
                values.append(row.algorithm)
            line += self.group_format(row.contender).format(*values)
        return line


def describe_hosts(hostnames: list[str]) -> str:
    ranks_per_host = Counter(hostnames)
    shown = ", ".join(f"{host} ({ranks})" for host, ranks in list(ranks_per_host.items())[:8])
    more = f", ... {len(ranks_per_host) - 8} more" if len(ranks_per_host) > 8 else ""
    plural = "s" if len(ranks_per_host) > 1 else ""
    return f"{len(hostnames)} ranks on {len(ranks_per_host)} host{plural}: {shown}{more}"


def header(collective: Collective, args: argparse.Namespace, hostnames: list[str]) -> list[str]:
    op = args.op if collective.has_op else "none"
    lines = [
        f"# torch_torus.bench: {collective.name}, {args.dtype}, redop {op}, device {args.device}",
        f"# {describe_hosts(hostnames)}",
        f"# {args.iters} timed calls after {args.warmup} warmup calls per size and contender, each "
        "call waited for before the next" + (
            f"; {args.rounds} rounds of every contender in turn, the best round counts" if args.rounds > 1 else "") + (
            f"; after the first round, as many calls as last {args.min_round_ms:g} ms"
            if args.rounds > 1 and args.min_round_ms > 0 else ""),
        f"# time = mean per call, slowest rank; algbw = size / time; "
        f"busbw = algbw * {collective.bus_factor_doc} (n = {collective.world_size})",
        f"# torch {torch.__version__}" + (
            f", torch_torus {getattr(sys.modules['torch_torus'], '__version__', '(no version)')}"
            if "torch_torus" in sys.modules else ""),
        "# contenders:",
    ]
    for index, contender in enumerate(args.contenders, 1):
        if contender.library:
            lines.append(f"#   [{index}] {contender.backend:<8} {contender.library}")
            continue
        options = " ".join(f"{key}={value}" for key, value in contender.options.items())
        over = f", over {contender.transport}" if contender.transport else ""
        lines.append(f"#   [{index}] {contender.backend:<8} options: {options or '(backend defaults)'}{over}")
    return lines + ["#"]


def baseline_index(contenders: list[Contender]) -> int:
    """Ratios are taken against gloo, the backend torch ships for CPU, else the first contender."""
    for index, contender in enumerate(contenders):
        if contender.label == "gloo":
            return index
    return 0


def summary(rows_by_size: list[list[Row]], args: argparse.Namespace) -> list[str]:
    contenders = args.contenders
    lines = ["#"]
    if args.check:
        wrong = sum(row.wrong for rows in rows_by_size for row in rows)
        lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    averages = [sum(rows[index].busbw for rows in rows_by_size) / len(rows_by_size)
                for index in range(len(contenders))]
    lines.append("# Avg bus bandwidth (GB/s): " + "  ".join(
        f"[{index}] {average:.3f}" for index, average in enumerate(averages, 1)))
    if len(contenders) < 2:
        return lines
    base = baseline_index(contenders)
    others = [index for index in range(len(contenders)) if index != base]
    lines += ["#", f"# busbw relative to [{base + 1}] {contenders[base].label} (above 1: faster)",
              "#" + "{:>11}".format("size") + "".join(f"  {f'[{index + 1}]':>8}" for index in others)]

    def ratio(value: float, reference: float) -> str:
        return f"{value / reference:8.2f}" if reference > 0 else f"{'-':>8}"

    for rows in rows_by_size:
        lines.append(f"{rows[0].size_bytes:>12}" + "".join(
            "  " + ratio(rows[index].busbw, rows[base].busbw) for index in others))
    lines.append("#" + "{:>11}".format("avg busbw") + "".join(
        "  " + ratio(averages[index], averages[base]) for index in others))
    return lines


def write_json(path: str, collective: Collective, args: argparse.Namespace, hostnames: list[str],
               rows_by_size: list[list[Row]]) -> None:
    document = {
        "collective": collective.name,
        "dtype": args.dtype,
        "op": args.op if collective.has_op else None,
        "root": collective.root if collective.has_root else None,
        "device": args.device,
        "world_size": collective.world_size,
        "hosts": dict(Counter(hostnames)),
        "iters": args.iters,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "min_round_ms": args.min_round_ms,
        "torch_version": torch.__version__,
        "contenders": [{"label": c.label, "backend": c.backend, "options": c.options,
                        "library": c.library} for c in args.contenders],
        "rows": [row.to_json() for rows in rows_by_size for row in rows],
    }
    with open(path, "w") as file:
        json.dump(document, file, indent=1)


def human_size(size: float) -> str:
    """4096 -> '4K', as the sizes are given on the command line."""
    for suffix in ("G", "M", "K"):
        if size >= SIZE_MULTIPLIERS[suffix.lower()]:
            return f"{size / SIZE_MULTIPLIERS[suffix.lower()]:g}{suffix}"
    return f"{size:g}"


def write_plot(path: str, collective: Collective, args: argparse.Namespace,
               rows_by_size: list[list[Row]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    figure, axes = plt.subplots(figsize=(8, 5))
    sizes = [rows[0].size_bytes for rows in rows_by_size]
    for index, contender in enumerate(args.contenders):
        axes.plot(sizes, [rows[index].busbw for rows in rows_by_size], marker="o",
                  label=contender.legend)
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(FuncFormatter(lambda size, _: human_size(size)))
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(f"{collective.name} {args.dtype}, {collective.world_size} ranks")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch_torus.bench",
        description="Measure a torch.distributed collective over a range of sizes for several\n"
                    "backends side by side, with nccl-tests' columns. Launch one process per\n"
                    "rank: torchrun (or any launcher setting MASTER_ADDR, MASTER_PORT, RANK and\n"
                    "WORLD_SIZE), mpiexec of MPICH or Open MPI (needs mpi4py), or srun.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  torchrun --nproc-per-node 4 -m torch_torus.bench -b 4K -e 64M --check\n"
               "  torchrun --nproc-per-node 8 -m torch_torus.bench --plot busbw.png \\\n"
               "      --backends 'torus:allreduce=ring;torus:allreduce=torus,torus_dims=2x4;gloo'\n"
               "  torchrun --nproc-per-node 4 -m torch_torus.bench --import-module "
               "oneccl_bindings_for_pytorch --backends ccl,gloo\n"
               f"  {MPI_LAUNCH_EXAMPLE}")
    parser.add_argument("-c", "--collective", choices=list(COLLECTIVES), default="allreduce",
                        help="collective to measure (default: %(default)s)")
    parser.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("4K"),
                        help="smallest size, bytes with optional K/M/G suffix (default: 4K)")
    parser.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"),
                        help="largest size (default: 64M)")
    parser.add_argument("-f", "--factor", type=int, default=2,
                        help="multiply the size by this from one row to the next "
                             "(default: %(default)s)")
    parser.add_argument("-d", "--dtype", choices=list(DTYPES), default="float32",
                        help="element type (default: %(default)s)")
    parser.add_argument("-o", "--op", choices=list(REDUCE_OPS), default="sum",
                        help="reduction for allreduce and reduce_scatter (default: %(default)s; "
                             "avg for floating dtypes only, and gloo has no avg)")
    parser.add_argument("-r", "--root", type=int, default=0,
                        help="source rank of broadcast (default: %(default)s)")
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="timed calls per size and contender (default: %(default)s)")
    parser.add_argument("-w", "--warmup", type=int, default=5,
                        help="untimed calls before them (default: %(default)s)")
    parser.add_argument("-R", "--rounds", type=int, default=1,
                        help="rounds per size: each round times every contender in turn, in a new "
                             "order each round, and a contender's time is its best round's, so that "
                             "drift of a shared machine hits every contender alike (default: "
                             "%(default)s)")
    parser.add_argument("--min-round-ms", type=float, default=0.0,
                        help="with --rounds > 1: after the first round, more calls per round where "
                             "--iters would take less than this (small sizes), up to 100x --iters, as "
                             "python -m torch_torus.tune does (default: %(default)s, off)")
    parser.add_argument(
        "--backends", "--backend", dest="backends", action="append", metavar="SPEC",
        help="contenders to compare, separated by ',' or ';' or given by repeating the flag. "
             "A contender is a registered backend name, for torus optionally with options: "
             "'torus:allreduce=ring,chunk_bytes=1M' (keys are the TORUS_* variables in lower "
             "case without the prefix; a oneCCL-style rule such as "
             "'allreduce=recursive_doubling:0-8192;ring:8193-max' may be written whole; quote the "
             "argument in a shell). 'mpi' is MPI's own collectives through mpi4py (under "
             "mpiexec only). Default: 'torus,gloo'")
    parser.add_argument("--import-module", action="append", default=[], metavar="MODULE",
                        help="import this module first, for backends it registers "
                             "(e.g. oneccl_bindings_for_pytorch for 'ccl'); repeatable")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the tensors live; cuda uses GPU LOCAL_RANK modulo the GPU "
                             "count (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="after timing each size, run one more call on known data and count "
                             "wrong elements in #wrong (slower; off by default, as nccl-tests "
                             "-c 0)")
    parser.add_argument("--json", metavar="PATH", help="also write every row to this JSON file")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw busbw against size, one line per contender, to this PNG "
                             "(needs matplotlib)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.contenders = parse_contenders(args.backends or ["torus,gloo"])
    except ValueError as error:
        parser.error(f"--backends: {error}")
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1 or args.min_round_ms < 0:
        parser.error("--iters and --rounds must be at least 1, --warmup and --min-round-ms at least 0")
    if args.op == "avg" and not DTYPES[args.dtype].is_floating_point:
        parser.error("--op avg needs a floating --dtype")
    if any(contender.backend == MPI_CONTENDER for contender in args.contenders):
        # MPI has no average; its buffers are numpy views, and numpy has no bfloat16; the MPIs
        # from PyPI are not CUDA-aware.
        if args.op not in MPI_REDUCE_OPS and COLLECTIVES[args.collective].has_op:
            parser.error(f"--op {args.op}: MPI has no such reduction; the mpi contender offers "
                         f"{', '.join(MPI_REDUCE_OPS)}")
        if args.dtype == "bfloat16":
            parser.error("--dtype bfloat16: the mpi contender passes numpy arrays, and numpy has "
                         "no bfloat16")
        if args.device != "cpu":
            parser.error(f"--device {args.device}: the mpi contender measures CPU tensors only")
    if args.plot:
        # Fail now rather than after a long run.
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import_backends(args.contenders, args.import_module)
    mpi_launch = init_env_under_mpiexec(args.contenders)

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        synchronize = torch.cuda.synchronize
    else:
        device, synchronize = torch.device("cpu"), lambda: None

    # Bootstrap group: barriers and gathering of times, the same for every contender.
    dist.init_process_group(backend="gloo")
    bootstrap = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not 0 <= args.root < world_size:
        raise SystemExit(f"--root {args.root} is not a rank of {world_size}")
    for contender in args.contenders:
        if contender.backend == MPI_CONTENDER:
            start_mpi_contender(contender, mpi_launch)
        else:
            contender.group = dist.new_group(backend=contender.backend,
                                             pg_options=contender.pg_options())
            if contender.backend == "torus":
                import torch_torus

                contender.transport = torch_torus._torus_backend(contender.group, "bench").config.transport

    hostnames: list[str] = [""] * world_size
    dist.all_gather_object(hostnames, socket.gethostname(), group=bootstrap)
    collective = COLLECTIVES[args.collective](world_size, rank, args.root)
    pattern = CheckPattern.make(args.op, world_size)
    table = Table(collective, args)

    def report(lines: list[str]) -> None:
        if rank == 0:
            print("\n".join(lines), flush=True)

    report(header(collective, args, hostnames) + table.header_lines())
    rows_by_size = []
    for count in counts_to_measure(collective, args):
        rows = measure_size(count, collective, args, pattern, bootstrap, device, synchronize)
        rows_by_size.append(rows)
        report([table.row_line(rows)])
    report(summary(rows_by_size, args))

    if rank == 0 and args.json:
        write_json(args.json, collective, args, hostnames, rows_by_size)
        print(f"# wrote {args.json}", flush=True)
    if rank == 0 and args.plot:
        write_plot(args.plot, collective, args, rows_by_size)
        print(f"# wrote {args.plot}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
