"""The algorithm family and its selection, on real process groups: every allgather,
reduce-scatter and broadcast algorithm, torus grids and inner algorithms, host-rowed grids,
algorithm_for, malformed settings, profiler names and debug logs.

(Every allreduce algorithm x dtype x op is covered in test_allreduce.py.)"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
from reference import compare, first_line, gen, reduce_ref, tolerance
from torch_torus.config import ALGORITHMS

pytestmark = pytest.mark.usefixtures("torus_only")

COUNTS = [0, 1, 2, 5, 1000, 20011]  # includes counts below the world size


@pytest.fixture
def torus_only(backend):
    expectations.skip_if_not_applicable(backend, "torus.algorithm")


def _group(ctx, **options):
    return ctx.new_group(list(range(ctx.world_size)), pg_options=ctx.pg_options(**{"chunk_bytes": 4096, **options}))


def _case_allgather(ctx, algorithm, dtype):
    group, n, problems = _group(ctx, allgather=algorithm), ctx.world_size, []
    for count in COUNTS:
        inputs = [gen(("ag", count), r, (count,), dtype) for r in range(n)]
        out = torch.empty(n * count, dtype=inputs[0].dtype)
        dist.all_gather_into_tensor(out, inputs[ctx.rank], group=group)
        problems += compare(out, torch.cat(inputs), label=f"all_gather_into_tensor {algorithm} count={count}")
        outs = [torch.empty_like(inputs[0]) for _ in range(n)]
        dist.all_gather(outs, inputs[ctx.rank], group=group)
        problems += compare(torch.cat(outs), torch.cat(inputs), label=f"all_gather {algorithm} count={count}")
    return problems


def _case_reduce_scatter(ctx, algorithm, dtype, op):
    group, n, problems = _group(ctx, reduce_scatter=algorithm), ctx.world_size, []
    for count in COUNTS:
        inputs = [gen(("rs", count), r, (n * count,), dtype, op) for r in range(n)]
        ref = reduce_ref(inputs, op)
        out = torch.empty(count, dtype=inputs[0].dtype)
        dist.reduce_scatter_tensor(out, inputs[ctx.rank].clone(), op=getattr(dist.ReduceOp, op), group=group)
        mine = ref[ctx.rank * count:(ctx.rank + 1) * count]
        mine_inputs = [x[ctx.rank * count:(ctx.rank + 1) * count] for x in inputs]
        problems += compare(out, mine, tolerance(mine_inputs, op, mine),
                            label=f"reduce_scatter_tensor {algorithm} {op} count={count}")
    return problems


def _case_broadcast(ctx, algorithm, dtype):
    group, n, problems = _group(ctx, broadcast=algorithm), ctx.world_size, []
    for root in range(n):
        for count in COUNTS:
            expected = gen(("bc", root, count), root, (count,), dtype)
            t = expected.clone() if ctx.rank == root else torch.zeros_like(expected)
            dist.broadcast(t, src=root, group=group)
            problems += compare(t, expected, label=f"broadcast {algorithm} root={root} count={count}")
    return problems


def _check_allreduce(ctx, group, dtype, op, label):
    n, problems = ctx.world_size, []
    for count in COUNTS:
        inputs = [gen(("ar", count), r, (count,), dtype, op) for r in range(n)]
        ref = reduce_ref(inputs, op)
        t = inputs[ctx.rank].clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        problems += compare(t, ref, tolerance(inputs, op, ref), label=f"all_reduce {label} count={count}")
    return problems


def _case_allreduce(ctx, options, dtype, op):
    return _check_allreduce(ctx, _group(ctx, **options), dtype, op, str(options))


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8], ids=lambda w: f"ws{w}")
def test_allgather_algorithms(backend, world_size, algorithm, dtype):
    harness.check(backend, world_size, _case_allgather, algorithm, dtype)


@pytest.mark.parametrize("dtype, op", [("float32", "SUM"), ("int32", "MAX"), ("float16", "SUM"),
                                       ("int64", "PRODUCT")])
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8], ids=lambda w: f"ws{w}")
def test_reduce_scatter_algorithms(backend, world_size, algorithm, dtype, op):
    harness.check(backend, world_size, _case_reduce_scatter, algorithm, dtype, op)


@pytest.mark.parametrize("dtype", ["float32", "uint8"])
@pytest.mark.parametrize("algorithm", ["binomial", "chain"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8], ids=lambda w: f"ws{w}")
def test_broadcast_algorithms(backend, world_size, algorithm, dtype):
    harness.check(backend, world_size, _case_broadcast, algorithm, dtype)


@pytest.mark.parametrize("inner", ["ring", "direct", "recursive_doubling", "rabenseifner"])
@pytest.mark.parametrize("dims", ["2x4", "4x2", "1x8", "8x1"])
def test_torus_grids_and_inner_algorithms(backend, dims, inner):
    harness.check(backend, 8, _case_allreduce,
                  {"allreduce": "torus", "torus_dims": dims, "torus_inner": inner}, "float32", "SUM")


@pytest.mark.parametrize("world_size", [6, 7], ids=lambda w: f"ws{w}")
def test_torus_default_grid_and_prime_fallback(backend, world_size):
    harness.check(backend, world_size, _case_allreduce, {"allreduce": "torus"}, "int32", "SUM")


def _case_host_rows(ctx):
    # Two fake hosts with interleaved ranks: rows must follow the hosts, not rank order. Ranks
    # on different hosts cannot use shared memory, so the transport is left to auto (tcp).
    group = _group(ctx, allreduce="torus", host_id=f"host{ctx.rank % 2}", transport="auto")
    return _check_allreduce(ctx, group, "float64", "SUM", "torus on host rows")


def test_torus_rows_follow_hosts(backend):
    harness.check(backend, 8, _case_host_rows)


def _case_algorithm_for(ctx):
    import torch_torus

    group = _group(ctx, allreduce="recursive_doubling:0-8192;ring:8193-1M;torus:1048577-max",
                   broadcast="chain")
    expected = {("allreduce", 0): "recursive_doubling", ("allreduce", 8192): "recursive_doubling",
                ("allreduce", 8193): "ring", ("allreduce", 1 << 20): "ring",
                ("allreduce", (1 << 20) + 1): "torus", ("broadcast", 5): "chain",
                ("alltoall", 5): "pairwise",
                # Over shared memory the barrier is the flags', else the messages'.
                ("barrier", 0): "shared_memory" if os.environ.get("TORUS_TRANSPORT") == "shm" else "dissemination"}
    problems = [f"algorithm_for{key} = {torch_torus.algorithm_for(*key, group)}, expected {value}"
                for key, value in expected.items() if torch_torus.algorithm_for(*key, group) != value]
    try:
        torch_torus.algorithm_for("allscatter", 5, group)
        problems.append("algorithm_for accepted an unknown collective")
    except ValueError as error:
        if "allscatter" not in str(error):
            problems.append(f"unknown collective error does not name it: {first_line(error)}")
    return problems


def test_algorithm_for_follows_rules(backend):
    harness.check(backend, 4, _case_algorithm_for)


def _case_bad_setting_fails_group_creation(ctx, option, value, needle):
    try:
        _group(ctx, **{option: value})
    except ValueError as error:
        return [] if needle in str(error) else [f"error does not name {needle!r}: {first_line(error)}"]
    return [f"a group was created with {option}={value!r}"]


@pytest.mark.parametrize("option, value, needle", [
    ("allreduce", "ring:0-10;direct:5-max", "overlap"),
    ("allreduce", "hypercube", "hypercube"),
    ("torus_dims", "3x3", "TORUS_TORUS_DIMS=3x3"),
    ("chunk_bytes", "0", "chunk_bytes"),
])
def test_bad_setting_fails_group_creation(backend, option, value, needle):
    harness.check(backend, 4, _case_bad_setting_fails_group_creation, option, value, needle)


def _case_profiler_names_algorithm(ctx):
    group = _group(ctx, allreduce="rabenseifner")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(64), group=group)
    names = {event.name for event in prof.events()}
    return [] if any("all_reduce:rabenseifner" in name for name in names) else \
        [f"no profiler event names the algorithm; events: {sorted(names)[:20]}"]


def test_profiler_trace_names_algorithm(backend):
    harness.check(backend, 2, _case_profiler_names_algorithm)


def _case_debug_log_names_algorithm(ctx):
    group = _group(ctx, allreduce="direct")
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            dist.all_reduce(torch.ones(8), group=group)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        text = captured.read().decode()
    return [] if "all_reduce:direct" in text else [f"debug log does not name the algorithm: {text!r}"]


def test_debug_log_names_algorithm(backend):
    harness.check(backend, 2, _case_debug_log_names_algorithm, env={"TORUS_LOG_LEVEL": "debug"})


@pytest.mark.parametrize("dtype, op", [("float32", "SUM"), ("int32", "MAX"), ("bfloat16", "SUM")])
@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
@pytest.mark.parametrize("world_size", [1, 5, 6, 7], ids=lambda w: f"ws{w}")
def test_allreduce_algorithms_other_world_sizes(backend, world_size, algorithm, dtype, op):
    """The world sizes test_allreduce.py's per-algorithm test leaves out: 1, a prime, 6 (2x3
    torus) and 7 (prime, torus runs as ring)."""
    harness.check(backend, world_size, _case_allreduce, {"allreduce": algorithm}, dtype, op)
