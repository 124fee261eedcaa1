"""all_reduce and broadcast of tensors of more than 2**31 elements (issue 16, item 11).

One int8 tensor of 2**31 + 3 elements (2 GiB + 3 bytes, an odd count) per rank, 2 ranks, over
each transport: every index above 2**31 - 1 and every byte offset above INT_MAX must reach the
right place. Inputs repeat a pattern of PERIOD elements (a prime, so a piece that lands at a
wrong offset differs from the expected values whatever chunk size moved it), distinct per rank
and never 0, so that a piece that never arrives (still the rank's input, or 0 in a broadcast)
is wrong too. Every element of the result is checked against the reference, in slices, and
the elements around 2**31 and at the end again against values computed from their indices.

Memory: one 2 GiB tensor per rank, reduced or broadcast in place; inputs are filled and results
compared slice by slice against the pattern tiled once over 64 MiB.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import expectations
import harness

# Every transport keeps these promises: they also run over OFI (conftest.py).
TRANSPORT_CONTRACT = True

WORLD_SIZE = 2
COUNT = 2**31 + 3
# The largest prime below 2**16: no chunk size the algorithms use (powers of two and their
# multiples by a few ranks) is a multiple of it.
PERIOD = 65521
# Elements filled and compared at a time: whole periods, about 64 MiB.
SLICE_ROWS = (64 << 20) // PERIOD
# Each case moves 2 GiB per rank and checks all of it: about 10 s here, on 2 busy cores.
CASE_TIMEOUT = 120.0

# The allreduce algorithms that run as themselves at 2 ranks on one host: "auto" (the group's
# own choice: ring over tcp, two_shot over shm) and each algorithm of the catalog. torus has no
# grid at 2 ranks and one_shot's slot is far smaller than 2 GiB, so they fall back to ones listed;
# two_shot needs shared memory, and over tcp falls back to ring (not run again there).
ALLREDUCE_ALGORITHMS = ["auto", "ring", "direct", "recursive_doubling", "rabenseifner", "two_shot"]
SHARED_MEMORY_ONLY = {"two_shot"}
# Broadcast: the group's own choice (chain, in chunks; binomial sends the same messages at 2
# ranks), and the whole tensor as one message of 2**31 + 3 bytes (a chunk size above it).
BROADCASTS = {"auto": {}, "one_message": {"chunk_bytes": "4G"}}


def _value(rank: int, index: int) -> int:
    """Rank `rank`'s input at `index`: in [-50, -1] or [1, 50], never 0."""
    v = (index % PERIOD * (2 * rank + 1) + 7 * rank) % 100
    return v - 50 if v < 50 else v - 49


def _pattern(rank: int) -> torch.Tensor:
    """_value(rank, i) for i in [0, PERIOD), as int8."""
    v = (torch.arange(PERIOD, dtype=torch.int64) * (2 * rank + 1) + 7 * rank) % 100
    return torch.where(v < 50, v - 50, v - 49).to(torch.int8)


def _sum_pattern(world_size: int) -> torch.Tensor:
    return sum(_pattern(r).to(torch.int64) for r in range(world_size)).to(torch.int8)


def _slices(t: torch.Tensor, pattern: torch.Tensor):
    """(slice of t, the pattern tiled over it) for consecutive slices covering t; each slice
    starts at a multiple of PERIOD, so one tiled block (64 MiB) serves them all."""
    tiled = pattern.repeat(SLICE_ROWS)
    for start in range(0, t.numel(), tiled.numel()):
        piece = t[start:start + tiled.numel()]
        yield start, piece, tiled[:piece.numel()]


def _fill(t: torch.Tensor, pattern: torch.Tensor) -> None:
    for _, piece, expected in _slices(t, pattern):
        piece.copy_(expected)


def _problems(t: torch.Tensor, pattern: torch.Tensor, expected_at, label: str) -> list:
    """Every element of t against the pattern tiled; the elements around 2**31 and the last
    ones again against expected_at(index)."""
    problems = []
    wrong_count = 0
    first = None
    for start, piece, expected in _slices(t, pattern):
        if torch.equal(piece, expected):
            continue
        wrong = piece.ne(expected).nonzero().flatten()
        wrong_count += wrong.numel()
        if first is None:
            first = start + int(wrong[0])
    if first is not None:
        problems.append(f"{label}: {wrong_count} of {t.numel()} elements wrong, the first at "
                        f"index {first}: {int(t[first])}, expected {expected_at(first)}")
    for index in [*range(2**31 - 2, 2**31 + 1), *range(t.numel() - 3, t.numel())]:
        if int(t[index]) != expected_at(index):
            problems.append(f"{label}: element {index} is {int(t[index])}, expected "
                            f"{expected_at(index)}")
    return problems


def _group(ctx, options: dict):
    """The world, or a new group of every rank with these torch_torus.Options."""
    if not options:
        return None
    return ctx.new_group(list(range(ctx.world_size)), pg_options=ctx.pg_options(**options))


def _ran(ctx, collective: str, group) -> str:
    """The algorithm the group runs the call with (torus), or the backend's name."""
    if ctx.backend != "torus":
        return ctx.backend
    import torch_torus

    return torch_torus.algorithm_for(collective, COUNT, group)


def _case_allreduce(ctx, algorithm: str) -> list:
    group = _group(ctx, {} if algorithm == "auto" else {"allreduce": algorithm})
    try:
        ran = _ran(ctx, "allreduce", group)
        t = torch.empty(COUNT, dtype=torch.int8)
        _fill(t, _pattern(ctx.rank))
        dist.all_reduce(t, group=group)
        n = ctx.world_size
        return _problems(t, _sum_pattern(n), lambda i: sum(_value(r, i) for r in range(n)),
                         f"all_reduce SUM of {COUNT} int8 ({algorithm}, ran {ran})")
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _case_broadcast(ctx, name: str, options: dict, root: int) -> list:
    group = _group(ctx, options)
    try:
        ran = _ran(ctx, "broadcast", group)
        if ctx.rank == root:
            t = torch.empty(COUNT, dtype=torch.int8)
            _fill(t, _pattern(root))
        else:
            t = torch.zeros(COUNT, dtype=torch.int8)
        dist.broadcast(t, src=root, group=group)
        return _problems(t, _pattern(root), lambda i: _value(root, i),
                         f"broadcast of {COUNT} int8 from rank {root} ({name}, ran {ran})")
    finally:
        if group is not None:
            dist.destroy_process_group(group)


@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
def test_allreduce_beyond_int32(backend, algorithm):
    if algorithm != "auto":
        expectations.skip_if_not_applicable(backend, "torus.algorithm")
    if algorithm in SHARED_MEMORY_ONLY and harness.split_backend(backend)[1].get("TORUS_TRANSPORT") == "tcp":
        pytest.skip(f"{algorithm} needs shared memory; over tcp it runs ring, tested as such")
    harness.check(backend, WORLD_SIZE, _case_allreduce, algorithm, timeout=CASE_TIMEOUT)


@pytest.mark.parametrize("name", list(BROADCASTS))
def test_broadcast_beyond_int32(backend, name):
    if BROADCASTS[name]:
        expectations.skip_if_not_applicable(backend, "torus.algorithm")
    harness.check(backend, WORLD_SIZE, _case_broadcast, name, BROADCASTS[name], WORLD_SIZE - 1,
                  timeout=CASE_TIMEOUT)
