"""The collectives the bench measures: their buffers, the call (through torch.distributed or
mpi4py), the bus factor of nccl-tests, and the exact result --check compares with."""

from __future__ import annotations

import dataclasses
import math
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

# The values 1..127 repeat along every --check input. Integers up to 127 are exact in every dtype
# offered (int8 included), and 127 is prime: a chunk or block that lands at a wrong offset, a
# power of two or a rank's share away, does not meet the same values there.
CHECK_VALUES = list(range(1, 128))


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
    memory_bytes_doc: str  # memory_bytes as a formula of S (size) and n
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

    def memory_bytes(self, size_bytes: int) -> int:
        """Bytes that must pass through memory when all ranks share one host's: every rank's
        input read once and its output written once (the bench's %mem bound)."""
        raise NotImplementedError

    def allocate(self, count: int, dtype: torch.dtype, empty: Callable[[int, torch.dtype], torch.Tensor]) -> Buffers:
        """The buffers of a call of `count` elements, each from empty(elements, dtype)."""
        tensor = empty(count, dtype)
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
    memory_bytes_doc = "2·n·S"

    def bus_factor(self):
        return 2 * (self.world_size - 1) / self.world_size

    def memory_bytes(self, size_bytes):
        return 2 * self.world_size * size_bytes

    def call(self, buffers, group, op):
        dist.all_reduce(buffers.input, op=op, group=group)

    def call_mpi(self, input, output, comm, op):
        comm.Allreduce(input, output, op)

    def expected(self, count, pattern):
        return periodic(pattern.reduced, 0, count)


class Broadcast(Collective):
    name, bus_factor_doc, has_root = "broadcast", "1", True
    memory_bytes_doc = "n·S"

    def bus_factor(self):
        return 1.0

    def memory_bytes(self, size_bytes):
        return self.world_size * size_bytes  # the root's read, every other rank's write

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
    memory_bytes_doc = "(n+1)·S"

    def count_for(self, size_bytes, itemsize):
        return max(1, size_bytes // (itemsize * self.world_size))

    def size_bytes(self, count, itemsize):
        return count * itemsize * self.world_size

    def bus_factor(self):
        return (self.world_size - 1) / self.world_size

    def buffer_lengths(self, count: int) -> tuple[int, int]:
        """Elements of the input and of the output."""
        raise NotImplementedError

    def allocate(self, count, dtype, empty):
        input_length, output_length = self.buffer_lengths(count)
        return Buffers(empty(input_length, dtype), empty(output_length, dtype))


class AllGather(ShardedCollective):
    name = "allgather"

    def memory_bytes(self, size_bytes):
        return size_bytes + self.world_size * size_bytes  # the shares read, every output written

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

    def memory_bytes(self, size_bytes):
        return self.world_size * size_bytes + size_bytes  # every input read, the shares written

    def buffer_lengths(self, count):
        return count * self.world_size, count

    def call(self, buffers, group, op):
        dist.reduce_scatter_single(buffers.output, buffers.input, op=op, group=group)

    def call_mpi(self, input, output, comm, op):
        comm.Reduce_scatter_block(input, output, op)

    def expected(self, count, pattern):
        return periodic(pattern.reduced, self.rank * count, count)


class AllToAll(ShardedCollective):
    name, memory_bytes_doc = "alltoall", "2·n·S"

    def memory_bytes(self, size_bytes):
        return 2 * self.world_size * size_bytes

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
