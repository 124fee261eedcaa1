"""all_reduce: every dtype x op, every world size, odd/empty/non-divisible counts, chunking,
non-contiguous tensors, coalesced calls, async work and futures."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
from torch_torus.config import ALGORITHMS as TORUS_ALGORITHMS
from reference import (DTYPE_NAMES, OPS, WORLD_SIZES, allreduce_contract, check_reduction,
                       compare, dtype_of, error_names_op, first_line, fmt_shape, gen, gen_all,
                       redop, reduce_ref, shapes_for, tolerance)

# Every transport keeps these promises: they also run over OFI (conftest.py).
TRANSPORT_CONTRACT = True

ws_param = pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"ws{w}")
CHUNK_ENV = {"TORUS_CHUNK_BYTES": "4096"}


# ------------------------------------------------------------------------------ cases


def _group_still_works(ctx, group=None) -> list:
    """After a rejected call the group must still be usable."""
    n = dist.get_world_size(group)
    t = torch.full((5,), float(dist.get_rank(group) + 1))
    try:
        dist.all_reduce(t, group=group)
    except Exception as e:
        return [f"group unusable after the rejected call: {first_line(e)}"]
    expected = float(n * (n + 1) // 2)
    return [] if t.eq(expected).all() else [f"group broken after the rejected call: {t.tolist()}"]


def _expect_rejected(ctx, dtype, op, group=None) -> list:
    t = gen(("rejected", dtype, op), ctx.rank, (7,), dtype, "SUM")
    try:
        dist.all_reduce(t, op=redop(op), group=group)
    except Exception as e:
        if not error_names_op(e, op):
            return [f"all_reduce({op}) on {dtype} raised as it should, but the error does not "
                    f"name the op {op}: {first_line(e)}"]
    else:
        return [f"all_reduce({op}) on {dtype} must raise (invalid pair) but returned "
                f"{t.tolist()}"]
    return _group_still_works(ctx, group)


def _case_allreduce(ctx, dtype, op, shapes=None, key="allreduce", group_opts=None):
    """all_reduce every shape with (dtype, op) and compare with the reference."""
    group = None
    if group_opts is not None:  # a fresh group of all ranks with these torus Options
        group = ctx.new_group(list(range(ctx.world_size)), pg_options=ctx.pg_options(**group_opts))
    n = ctx.world_size
    problems = []
    try:
        if allreduce_contract(op, dtype) == "error":
            return _expect_rejected(ctx, dtype, op, group)
        for shape in shapes or shapes_for(n):
            shape = tuple(shape)
            inputs = gen_all((key, dtype, op, shape), n, shape, dtype, op)
            t = inputs[ctx.rank].clone()
            label = f"{dtype} {op} shape={fmt_shape(shape)}"
            try:
                dist.all_reduce(t, op=redop(op), group=group)
            except Exception as e:
                problems.append(f"{label}: raised {first_line(e)}")
                break
            problems += check_reduction(t, inputs, op, label)
        return problems
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _case_uint8_wraps(ctx):
    """Unsigned sums wrap modulo 256 like torch (values 200..255 on every rank)."""
    n = ctx.world_size
    g = torch.Generator().manual_seed(1234)
    inputs = [torch.randint(200, 256, (257,), generator=g, dtype=torch.int64).to(torch.uint8)
              for _ in range(n)]
    t = inputs[ctx.rank].clone()
    dist.all_reduce(t)
    return check_reduction(t, inputs, "SUM", "uint8 SUM wrap-around")


# non-contiguous layouts: f(base) -> view, applied to a flat buffer reshaped to base_shape
LAYOUTS = {
    "transposed": ((5, 7), lambda b: b.t()),
    "strided": ((2 * 1001 + 1,), lambda b: b[1::2]),
    "columns": ((6, 9), lambda b: b[:, 2:6]),
    "rows_strided": ((8, 5), lambda b: b[::3]),
    "permuted3d": ((3, 4, 5), lambda b: b.permute(2, 0, 1)),
    "channels_last": ((2, 4, 5, 3), lambda b: b.permute(0, 3, 1, 2)),
    "offset": ((40,), lambda b: b[5:16]),
}


def _case_noncontig(ctx, layout, dtype, op="SUM"):
    n = ctx.world_size
    base_shape, f = LAYOUTS[layout]
    numel = 1
    for s in base_shape:
        numel *= s
    index = f(torch.arange(numel).reshape(base_shape))
    sentinel = 77
    flat = torch.full((numel,), sentinel, dtype=dtype_of(dtype))
    view = f(flat.reshape(base_shape))
    inputs = gen_all(("noncontig", layout, dtype), n, view.shape, dtype, op)
    view.copy_(inputs[ctx.rank])
    label = f"{layout} view {tuple(view.shape)} strides {view.stride()} {dtype} {op}"
    problems = []
    if view.is_contiguous() and layout not in ("offset",):
        problems.append(f"test bug: {label} is contiguous")
    try:
        dist.all_reduce(view, op=redop(op))
    except Exception as e:
        return [f"{label}: raised {first_line(e)}"]
    problems += check_reduction(view, inputs, op, label)
    outside = torch.ones(numel, dtype=torch.bool)
    outside[index.reshape(-1)] = False
    changed = (flat[outside] != sentinel).sum().item()
    if changed:
        problems.append(f"{label}: {changed} elements changed outside the view "
                        f"(in-place write-back went to the wrong places)")
    return problems


def _case_coalesced(ctx, api, dtype, op):
    n = ctx.world_size
    shapes = [(3,), (0,), (1001,), (4, 5), (), (2 * n + 1,)]
    inputs = [gen_all(("coalesced", api, dtype, op, s), n, s, dtype, op) for s in shapes]
    ts = [inp[ctx.rank].clone() for inp in inputs]
    label = f"{api} {dtype} {op}"
    try:
        if api == "pg":
            pg = dist.distributed_c10d._get_default_group()
            opts = dist.AllreduceCoalescedOptions()
            opts.reduceOp = redop(op)
            pg.allreduce_coalesced(ts, opts).wait()
        elif api in ("manager_sync", "manager_async"):
            is_async = api == "manager_async"
            with dist._coalescing_manager(async_ops=is_async) as cm:
                for t in ts:
                    dist.all_reduce(t, op=redop(op), async_op=is_async)
            if is_async:
                cm.wait()
        else:
            raise ValueError(api)
    except Exception as e:
        return [f"{label}: raised {first_line(e)}"]
    problems = []
    for s, t, inp in zip(shapes, ts, inputs):
        problems += check_reduction(t, inp, op, f"{label} tensor shape={fmt_shape(s)}")
    return problems


def _case_coalesced_mixed(ctx):
    """Tensors of different dtypes in one coalesced call: correct results, or an error
    (then the group must stay usable).  Never wrong data."""
    n = ctx.world_size
    specs = [("float32", (5,)), ("float64", (3,)), ("int32", (4,))]
    inputs = [gen_all(("mixed", d, s), n, s, d) for d, s in specs]
    ts = [inp[ctx.rank].clone() for inp in inputs]
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    try:
        pg.allreduce_coalesced(ts, opts).wait()
    except Exception:
        return _group_still_works(ctx)
    problems = []
    for (d, s), t, inp in zip(specs, ts, inputs):
        problems += check_reduction(t, inp, "SUM", f"mixed coalesced {d}")
    return problems


def _case_async(ctx):
    n = ctx.world_size
    problems = []

    def fresh(i, shape=None, dtype="float32"):
        shape = shape or (1000 + i,)
        inputs = gen_all(("async", i), n, shape, dtype)
        return inputs, inputs[ctx.rank].clone()

    # 1. wait(), then is_completed(), then the future's value
    inputs, t = fresh(0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    problems += check_reduction(t, inputs, "SUM", "after work.wait()")
    if not work.is_completed():
        problems.append("work.is_completed() is False after work.wait()")
    value = work.get_future().wait()
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], torch.Tensor):
        problems.append(f"work.get_future().wait() should be [tensor], got {type(value)} "
                        f"{value!r:.200}")
    else:
        problems += compare(value[0], t, None, "future value[0] vs the reduced tensor")

    # 2. the future alone, without work.wait()
    inputs, t = fresh(1)
    work = dist.all_reduce(t, async_op=True)
    value = work.get_future().wait()
    problems += check_reduction(t, inputs, "SUM", "after get_future().wait() only")
    if isinstance(value, list) and value:
        problems += check_reduction(value[0], inputs, "SUM", "future value (no work.wait())")
    else:
        problems.append(f"future value: {value!r:.200}")
    deadline = time.monotonic() + 2.0  # may lag the future a little (gloo's does)
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not work.is_completed():
        problems.append("is_completed() still False 2s after its future completed")

    # 3. many outstanding works, waited in reverse order
    many = [fresh(10 + i) for i in range(8)]
    works = [dist.all_reduce(t, async_op=True) for _, t in many]
    for w in reversed(works):
        w.wait()
    for i, (inputs, t) in enumerate(many):
        problems += check_reduction(t, inputs, "SUM", f"outstanding work #{i}")

    # 4. chained callbacks
    inputs, t = fresh(2)
    fut = dist.all_reduce(t, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2).then(lambda f: f.value() + 1)
    out = chained.wait()
    ref = reduce_ref(inputs, "SUM") * 2 + 1
    problems += compare(out, ref, tolerance(inputs, "SUM", ref) * 2 + 1e-6, "chained callback")

    # 5. a callback that issues another collective on completion (as DDP hooks do)
    inputs, t = fresh(3)
    second = {}

    def cb(f):
        u = f.value()[0].clone()
        second["work"] = dist.all_reduce(u, op=dist.ReduceOp.MAX, async_op=True)
        second["t"] = u
        return u

    dist.all_reduce(t, async_op=True).get_future().then(cb).wait()
    second["work"].wait()
    s = reduce_ref(inputs, "SUM")
    problems += compare(second["t"], s, tolerance(inputs, "SUM", s), "collective from callback")

    # 6. async on an empty tensor and on int64
    for label, (inputs, t) in (("empty", fresh(4, (0,))), ("int64", fresh(5, (77,), "int64"))):
        w = dist.all_reduce(t, async_op=True)
        v = w.get_future().wait()
        w.wait()
        problems += check_reduction(t, inputs, "SUM", f"async {label}")
        if not isinstance(v, list) or len(v) != 1:
            problems.append(f"async {label}: future value {v!r:.200}")
    return problems


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@ws_param
def test_allreduce(backend, world_size, dtype, op):
    harness.check(backend, world_size, _case_allreduce, dtype, op,
                  gap=expectations.gap(backend, "all_reduce", dtype, op))


@ws_param
def test_allreduce_uint8_wraps(backend, world_size):
    harness.check(backend, world_size, _case_uint8_wraps,
                  gap=expectations.gap(backend, "all_reduce", "uint8", "SUM"))


def _chunk_shapes(dtype, world_size):
    elems = 4096 // torch.empty((), dtype=dtype_of(dtype)).element_size()
    per_ring = elems * world_size
    return [(per_ring - 1,), (per_ring,), (per_ring + 1,), (8 * per_ring + 13,)]


@pytest.mark.parametrize("op", ["SUM", "MAX"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", [2, 3, 4, 8], ids=lambda w: f"ws{w}")
def test_allreduce_chunked(backend, world_size, dtype, op):
    """Counts around and far above the chunk size (TORUS_CHUNK_BYTES=4096, separate pool)."""
    harness.check(backend, world_size, _case_allreduce, dtype, op,
                  _chunk_shapes(dtype, world_size), "chunked", env=CHUNK_ENV,
                  gap=expectations.gap(backend, "all_reduce.chunked", dtype, op))


ALGORITHMS = list(TORUS_ALGORITHMS["allreduce"])


@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("float16", "SUM"),
                                      ("int32", "SUM"), ("float64", "AVG"),
                                      ("int64", "MAX"), ("bfloat16", "PRODUCT"),
                                      ("uint8", "BXOR"), ("bool", "SUM")])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [2, 3, 4, 8], ids=lambda w: f"ws{w}")
def test_allreduce_algorithm(backend, world_size, algorithm, dtype, op):
    """Each algorithm (torch_torus.Options(allreduce=..., chunk_bytes=4096) on a new group)."""
    expectations.skip_if_not_applicable(backend, "torus.algorithm")
    shapes = shapes_for(world_size) + _chunk_shapes(dtype, world_size)
    harness.check(backend, world_size, _case_allreduce, dtype, op, shapes, f"algo-{algorithm}",
                  {"allreduce": algorithm, "chunk_bytes": 4096})


RULES_ENV = {"TORUS_ALLREDUCE": "recursive_doubling:0-8192;torus:8193-1048576;ring:1048577-max",
             "TORUS_CHUNK_BYTES": "65536"}


@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("world_size", [4], ids=lambda w: f"ws{w}")
def test_allreduce_env_rules(backend, world_size, dtype):
    """A size-ranged TORUS_ALLREDUCE rule string; counts in each of the three ranges."""
    expectations.skip_if_not_applicable(backend, "torus.env")
    shapes = [(7,), (2047,), (2049,), (100003,), (300001,)]
    harness.check(backend, world_size, _case_allreduce, dtype, "SUM", shapes, "rules",
                  env=RULES_ENV)


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@ws_param
def test_allreduce_noncontiguous(backend, world_size, layout, dtype):
    harness.check(backend, world_size, _case_noncontig, layout, dtype,
                  gap=expectations.gap(backend, f"all_reduce.noncontig.{layout}", dtype, "SUM",
                                       world_size))


@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("int64", "SUM"), ("int64", "MAX"),
                                      ("float16", "SUM"), ("bool", "BOR")])
@pytest.mark.parametrize("api", ["pg", "manager_sync", "manager_async"])
@ws_param
def test_allreduce_coalesced(backend, world_size, api, dtype, op):
    harness.check(backend, world_size, _case_coalesced, api, dtype, op,
                  gap=expectations.gap(backend, "all_reduce.coalesced", dtype, op))


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"ws{w}")
def test_allreduce_coalesced_mixed_dtypes(backend, world_size):
    harness.check(backend, world_size, _case_coalesced_mixed)


@ws_param
def test_allreduce_async_and_futures(backend, world_size):
    harness.check(backend, world_size, _case_async)
