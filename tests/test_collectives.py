"""Every other collective: broadcast, reduce, all_gather(+_into_tensor, _object), gather,
scatter, reduce_scatter(+_tensor), all_to_all(+_single), barrier, broadcast_object_list, async
variants and coalescing. Point to point is in test_collectives_p2p.py."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
from collective_helpers import attempt, group_still_works, strided
from reference import (DTYPE_NAMES, WORLD_SIZES, allreduce_contract, check_reduction, compare,
                       dtype_of, error_names_op, first_line, fmt_shape, gen, gen_all, redop)

# Every transport keeps these promises: they also run over OFI (conftest.py).
TRANSPORT_CONTRACT = True

ws_param = pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"ws{w}")
dtype_param = pytest.mark.parametrize("dtype", DTYPE_NAMES)
REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
RS_OPS = ["SUM", "MAX", "AVG", "BXOR"]


def _shapes(n):
    return [(0,), (), (1,), (7,), (13 * n + 1,), (2, 3, 5), (3, 0), (1031,)]


# ------------------------------------------------------------------------------ broadcast


def _case_broadcast(ctx, dtype, noncontig=False):
    n, rank, problems = ctx.world_size, ctx.rank, []
    for root in range(n):
        for shape in _shapes(n) if not noncontig else [(13 * n + 1,), (4, 6)]:
            mine = gen(("bcast", root, shape), rank, shape, dtype)
            t = strided(mine) if noncontig else mine.clone()
            label = f"broadcast root={root} {dtype} shape={fmt_shape(shape)}"
            if noncontig:
                label += f" strides={t.stride()}"
            if not attempt(lambda: dist.broadcast(t, src=root), label, problems):
                return problems
            problems += compare(t, gen(("bcast", root, shape), root, shape, dtype), None, label)
    return problems


@dtype_param
@ws_param
def test_broadcast(backend, world_size, dtype):
    harness.check(backend, world_size, _case_broadcast, dtype,
                  gap=expectations.gap(backend, "broadcast", dtype, world_size=world_size))


@ws_param
def test_broadcast_noncontiguous(backend, world_size):
    harness.check(backend, world_size, _case_broadcast, "float32", True,
                  gap=expectations.gap(backend, "broadcast.noncontig", "float32",
                                       world_size=world_size))


# ------------------------------------------------------------------------------ reduce


def _case_reduce(ctx, dtype, op):
    n, rank, problems = ctx.world_size, ctx.rank, []
    if allreduce_contract(op, dtype) == "error":
        t = gen("reduce-bad", rank, (5,), dtype)
        try:
            dist.reduce(t, dst=0, op=redop(op))
        except Exception as e:
            if not error_names_op(e, op):
                problems.append(f"reduce({op}) on {dtype} raised as it should, but the error "
                                f"does not name the op {op}: {first_line(e)}")
        else:
            problems.append(f"reduce({op}) on {dtype} must raise (invalid pair)")
        return problems
    for root in range(n):
        for shape in [(0,), (), (13 * n + 1,), (2, 3, 5)]:
            inputs = gen_all(("reduce", root, shape), n, shape, dtype, op)
            t = inputs[rank].clone()
            label = f"reduce dst={root} {dtype} {op} shape={fmt_shape(shape)}"
            if not attempt(lambda: dist.reduce(t, dst=root, op=redop(op)), label, problems):
                return problems
            if rank == root:
                problems += check_reduction(t, inputs, op, label)
    return problems


@pytest.mark.parametrize("op", REDUCE_OPS)
@dtype_param
@ws_param
def test_reduce(backend, world_size, dtype, op):
    harness.check(backend, world_size, _case_reduce, dtype, op,
                  gap=expectations.gap(backend, "reduce", dtype, op, world_size))


# ------------------------------------------------------------------------------ all_gather


def _case_all_gather(ctx, dtype, noncontig=False):
    n, rank, problems = ctx.world_size, ctx.rank, []
    for shape in _shapes(n) if not noncontig else [(13 * n + 1,), (4, 6)]:
        inputs = gen_all(("ag", shape), n, shape, dtype)
        label = f"all_gather {dtype} shape={fmt_shape(shape)}"
        if noncontig:  # non-contiguous input and outputs that are views into one buffer
            x = strided(inputs[rank])
            buf = torch.zeros(shape + (n,), dtype=dtype_of(dtype))
            outs = [buf[..., j] for j in range(n)]
            label += " (strided input, outputs = slices of one buffer)"
        else:
            x = inputs[rank].clone()
            outs = [torch.empty(shape, dtype=dtype_of(dtype)) for _ in range(n)]
        if not attempt(lambda: dist.all_gather(outs, x), label, problems):
            return problems
        for j in range(n):
            problems += compare(outs[j], inputs[j], None, f"{label} output[{j}]")
        problems += compare(x, inputs[rank], None, f"{label} input modified")
    return problems


@dtype_param
@ws_param
def test_all_gather(backend, world_size, dtype):
    harness.check(backend, world_size, _case_all_gather, dtype,
                  gap=expectations.gap(backend, "all_gather", dtype, world_size=world_size))


@ws_param
def test_all_gather_noncontiguous(backend, world_size):
    harness.check(backend, world_size, _case_all_gather, "float32", True,
                  gap=expectations.gap(backend, "all_gather.noncontig", "float32",
                                       world_size=world_size))


def _case_all_gather_into_tensor(ctx, dtype, form):
    """form "concat": output is the inputs concatenated along dim 0; "stack": stacked."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    for shape in [(0,), (1,), (7,), (13 * n + 1,), (2, 3, 5), (1031,)] + [()] * (form == "stack"):
        inputs = gen_all(("agt", shape), n, shape, dtype)
        label = f"all_gather_into_tensor {dtype} shape={fmt_shape(shape)} {form}"
        if form == "concat":
            out = torch.empty((shape[0] * n,) + shape[1:], dtype=dtype_of(dtype))
            expected = torch.cat(inputs)
        else:
            out = torch.empty((n,) + shape, dtype=dtype_of(dtype))
            expected = torch.stack(inputs)
        if not attempt(lambda: dist.all_gather_into_tensor(out, inputs[rank].clone()), label,
                    problems):
            return problems
        problems += compare(out, expected, None, label)
    return problems


@pytest.mark.parametrize("form", ["concat", "stack"])
@dtype_param
@ws_param
def test_all_gather_into_tensor(backend, world_size, dtype, form):
    harness.check(backend, world_size, _case_all_gather_into_tensor, dtype, form,
                  gap=expectations.gap(backend, f"all_gather_into_tensor.{form}", dtype,
                                       world_size=world_size))


def _case_all_gather_object(ctx):
    n, rank = ctx.world_size, ctx.rank

    def obj(r):
        return {"rank": r, "s": "x" * (r * 37 + 1), "list": list(range(r)), "t": (r, None),
                "tensor": torch.arange(r + 1), "big": bytes(range(256)) * (r + 1)}

    out = [None] * n
    dist.all_gather_object(out, obj(rank))
    problems = []
    for j in range(n):
        got, exp = out[j], obj(j)
        if not (isinstance(got, dict) and got.keys() == exp.keys()
                and all(torch.equal(got[k], exp[k]) if k == "tensor" else got[k] == exp[k]
                        for k in exp)):
            problems.append(f"all_gather_object: object from rank {j} is {got!r:.200}")
    return problems


@ws_param
def test_all_gather_object(backend, world_size):
    harness.check(backend, world_size, _case_all_gather_object)


# ------------------------------------------------------------------------------ gather/scatter


def _case_gather(ctx, dtype, noncontig=False):
    n, rank, problems = ctx.world_size, ctx.rank, []
    for root in range(n):
        for shape in [(0,), (), (7,), (13 * n + 1,), (2, 3, 5)] if not noncontig else [(9,), (3, 4)]:
            inputs = gen_all(("gather", root, shape), n, shape, dtype)
            x = strided(inputs[rank]) if noncontig else inputs[rank].clone()
            outs = None
            if rank == root:
                if noncontig:
                    buf = torch.zeros(shape + (n,), dtype=dtype_of(dtype))
                    outs = [buf[..., j] for j in range(n)]
                else:
                    outs = [torch.empty(shape, dtype=dtype_of(dtype)) for _ in range(n)]
            label = f"gather dst={root} {dtype} shape={fmt_shape(shape)}"
            if not attempt(lambda: dist.gather(x, outs, dst=root), label, problems):
                return problems
            if rank == root:
                for j in range(n):
                    problems += compare(outs[j], inputs[j], None, f"{label} from rank {j}")
    return problems


@dtype_param
@ws_param
def test_gather(backend, world_size, dtype):
    harness.check(backend, world_size, _case_gather, dtype,
                  gap=expectations.gap(backend, "gather", dtype, world_size=world_size))


@ws_param
def test_gather_noncontiguous(backend, world_size):
    harness.check(backend, world_size, _case_gather, "float32", True,
                  gap=expectations.gap(backend, "gather.noncontig", "float32",
                                       world_size=world_size))


def _case_scatter(ctx, dtype, noncontig=False):
    n, rank, problems = ctx.world_size, ctx.rank, []
    for root in range(n):
        for shape in [(0,), (), (7,), (13 * n + 1,), (2, 3, 5)] if not noncontig else [(9,), (3, 4)]:
            pieces = [gen(("scatter", root, shape, j), root, shape, dtype) for j in range(n)]
            ins = None
            if rank == root:
                ins = [strided(p) if noncontig else p.clone() for p in pieces]
            out = gen(("scatter-out", shape), rank, shape, dtype)
            if noncontig:
                out = strided(out)
            label = f"scatter src={root} {dtype} shape={fmt_shape(shape)}"
            if not attempt(lambda: dist.scatter(out, ins, src=root), label, problems):
                return problems
            problems += compare(out, pieces[rank], None, label)
    return problems


@dtype_param
@ws_param
def test_scatter(backend, world_size, dtype):
    harness.check(backend, world_size, _case_scatter, dtype,
                  gap=expectations.gap(backend, "scatter", dtype, world_size=world_size))


@ws_param
def test_scatter_noncontiguous(backend, world_size):
    harness.check(backend, world_size, _case_scatter, "float32", True,
                  gap=expectations.gap(backend, "scatter.noncontig", "float32",
                                       world_size=world_size))


# ------------------------------------------------------------------------------ reduce_scatter


def _rs_expect_rejected(ctx, dtype, op, call):
    problems = []
    try:
        call()
    except Exception as e:
        if not error_names_op(e, op):
            problems.append(f"{op} on {dtype} raised as it should, but the error does not "
                            f"name the op {op}: {first_line(e)}")
    else:
        problems.append(f"{op} on {dtype} must raise (invalid pair)")
    return problems


def _case_reduce_scatter(ctx, dtype, op, form):
    """form: "list" (dist.reduce_scatter), "concat"/"stack" (reduce_scatter_tensor)."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    dt = dtype_of(dtype)

    def call(out, pieces):
        if form == "list":
            dist.reduce_scatter(out, [p.clone() for p in pieces], op=redop(op))
        elif form == "concat":
            dist.reduce_scatter_tensor(out, torch.cat(pieces), op=redop(op))
        else:
            dist.reduce_scatter_tensor(out, torch.stack(pieces), op=redop(op))

    if allreduce_contract(op, dtype) == "error":
        pieces = [gen("rs-bad", rank, (3,), dtype) for _ in range(n)]
        return _rs_expect_rejected(ctx, dtype, op, lambda: call(torch.empty(3, dtype=dt), pieces))
    for shape in [(0,), (1,), (7,), (13 * n + 1,), (2, 3, 5), (1031,)]:
        # pieces[j] on rank r = gen((key, j), r): rank j gets the reduction over r
        mine = [gen(("rs", shape, j), rank, shape, dtype, op) for j in range(n)]
        contributions = gen_all(("rs", shape, rank), n, shape, dtype, op)
        out = torch.empty(shape, dtype=dt)
        label = f"reduce_scatter[{form}] {dtype} {op} shape={fmt_shape(shape)}"
        if not attempt(lambda: call(out, mine), label, problems):
            return problems
        problems += check_reduction(out, contributions, op, label)
    return problems


@pytest.mark.parametrize("op", RS_OPS)
@dtype_param
@ws_param
def test_reduce_scatter(backend, world_size, dtype, op):
    harness.check(backend, world_size, _case_reduce_scatter, dtype, op, "list",
                  gap=expectations.gap(backend, "reduce_scatter", dtype, op, world_size))


@pytest.mark.parametrize("op", RS_OPS)
@dtype_param
@ws_param
def test_reduce_scatter_tensor(backend, world_size, dtype, op):
    """Input = the world_size pieces concatenated along dim 0."""
    harness.check(backend, world_size, _case_reduce_scatter, dtype, op, "concat",
                  gap=expectations.gap(backend, "reduce_scatter_tensor.concat", dtype, op,
                                       world_size))


@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("int64", "MAX"), ("bfloat16", "AVG"),
                                      ("bool", "BXOR")])
@ws_param
def test_reduce_scatter_tensor_stacked(backend, world_size, dtype, op):
    """Input = the pieces stacked: shape [world_size, *output.shape]."""
    harness.check(backend, world_size, _case_reduce_scatter, dtype, op, "stack",
                  gap=expectations.gap(backend, "reduce_scatter_tensor.stack", dtype, op,
                                       world_size))


# ------------------------------------------------------------------------------ all_to_all


def _split(pattern, src, dst, n):
    if pattern == "even":
        return 3
    if pattern == "uneven":
        return (src * 7 + dst * 3) % 4  # includes zeros
    if pattern == "rank0_sends_nothing":
        return 0 if src == 0 else (src + dst) % 3 + 1
    raise ValueError(pattern)


def _case_all_to_all(ctx, dtype, pattern):
    n, rank, problems = ctx.world_size, ctx.rank, []
    dt = dtype_of(dtype)
    ins = [gen(("a2a", pattern, rank, j), rank, (_split(pattern, rank, j, n), 2), dtype)
           for j in range(n)]
    outs = [torch.empty((_split(pattern, i, rank, n), 2), dtype=dt) for i in range(n)]
    label = f"all_to_all(list) {dtype} {pattern}"
    if not attempt(lambda: dist.all_to_all(outs, [t.clone() for t in ins]), label, problems):
        return problems
    for i in range(n):
        exp = gen(("a2a", pattern, i, rank), i, (_split(pattern, i, rank, n), 2), dtype)
        problems += compare(outs[i], exp, None, f"{label} from rank {i}")
    return problems


@pytest.mark.parametrize("pattern", ["even", "uneven"])
@dtype_param
@ws_param
def test_all_to_all(backend, world_size, dtype, pattern):
    harness.check(backend, world_size, _case_all_to_all, dtype, pattern,
                  gap=expectations.gap(backend, f"all_to_all.{pattern}", dtype,
                                       world_size=world_size))


def _case_all_to_all_single(ctx, dtype, pattern, noncontig=False):
    """noncontig: column-major input and output.  Like NCCL and gloo, a backend may refuse
    them with an error that says "contiguous" (then the group must stay usable); if it
    accepts them, the result must be right."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    dt = dtype_of(dtype)
    in_splits = [_split(pattern, rank, j, n) for j in range(n)]
    out_splits = [_split(pattern, i, rank, n) for i in range(n)]
    blocks = [gen(("a2as", pattern, rank, j), rank, (in_splits[j], 2), dtype) for j in range(n)]
    x = torch.cat(blocks)
    out = torch.full((sum(out_splits), 2), 0, dtype=dt)
    if noncontig:  # transposed storage for input and output
        x = x.t().contiguous().t()
        out = out.t().contiguous().t()
    label = f"all_to_all_single {dtype} {pattern}" + (" (column-major in/out)" if noncontig else "")
    kw = {} if pattern == "even" else {"output_split_sizes": out_splits,
                                       "input_split_sizes": in_splits}
    try:
        dist.all_to_all_single(out, x, **kw)
    except Exception as e:
        if noncontig and "contiguous" in str(e).lower():
            return group_still_works()
        return [f"{label}: raised {first_line(e)}"]
    exp = torch.cat([gen(("a2as", pattern, i, rank), i, (out_splits[i], 2), dtype)
                     for i in range(n)])
    problems += compare(out, exp, None, label + f" in_splits={in_splits} out_splits={out_splits}")
    return problems


@pytest.mark.parametrize("pattern", ["even", "uneven", "rank0_sends_nothing"])
@dtype_param
@ws_param
def test_all_to_all_single(backend, world_size, dtype, pattern):
    harness.check(backend, world_size, _case_all_to_all_single, dtype, pattern,
                  gap=expectations.gap(backend, "all_to_all_single", dtype,
                                       world_size=world_size))


@pytest.mark.parametrize("pattern", ["even", "uneven"])
@ws_param
def test_all_to_all_single_noncontiguous(backend, world_size, pattern):
    harness.check(backend, world_size, _case_all_to_all_single, "float32", pattern, True,
                  gap=expectations.gap(backend, "all_to_all_single.noncontig", "float32",
                                       world_size=world_size))


# ------------------------------------------------------------------------------ barrier


def _case_barrier(ctx, rounds=3):
    n, rank, problems = ctx.world_size, ctx.rank, []
    d = os.path.join(ctx.scratch, f"barrier-{ctx.state.setdefault('barrier', 0)}")
    ctx.state["barrier"] += 1
    os.makedirs(d, exist_ok=True)
    for i in range(rounds):
        if rank == i % n:
            time.sleep(0.3)  # a late rank: nobody may leave the barrier before it arrives
        open(os.path.join(d, f"{i}-{rank}"), "w").close()
        dist.barrier()
        missing = [r for r in range(n) if not os.path.exists(os.path.join(d, f"{i}-{r}"))]
        if missing:
            problems.append(f"round {i}: left the barrier before rank(s) {missing} arrived")
    w = dist.barrier(async_op=True)
    w.wait()
    return problems


@ws_param
def test_barrier(backend, world_size):
    harness.check(backend, world_size, _case_barrier)


@pytest.mark.parametrize("algorithm", ["shared_memory", "dissemination"])
@pytest.mark.parametrize("world_size", [3, 8], ids=lambda w: f"ws{w}")
def test_barrier_algorithms(backend, world_size, algorithm):
    # Each asked for by name: shared_memory runs over shm, and as dissemination elsewhere.
    harness.check(backend, world_size, _case_barrier, env={"TORUS_BARRIER": algorithm})


# ------------------------------------------------------------------------------ objects


def _case_broadcast_object_list(ctx):
    n, rank, problems = ctx.world_size, ctx.rank, []
    for root in range(n):
        def objs(r):
            return [{"root": r, "payload": "y" * (100 * r + 3)}, (r, [r] * r), None,
                    torch.full((r + 2,), float(r)), b"\x00" * 1000]

        lst = objs(root) if rank == root else [None] * 5
        dist.broadcast_object_list(lst, src=root)
        exp = objs(root)
        for i, (got, e) in enumerate(zip(lst, exp)):
            ok = torch.equal(got, e) if isinstance(e, torch.Tensor) else got == e
            if not ok:
                problems.append(f"broadcast_object_list root={root} item {i}: {got!r:.100}")
    return problems


@ws_param
def test_broadcast_object_list(backend, world_size):
    harness.check(backend, world_size, _case_broadcast_object_list)


# ------------------------------------------------------------------------------ async, coalesced


def _case_async_collectives(ctx):
    """async_op=True for the collectives FSDP and users overlap; futures give the outputs."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    k = 2 * n + 3
    # all_gather_into_tensor
    inputs = gen_all("async-ag", n, (k,), "float32")
    out = torch.empty(n * k)
    w1 = dist.all_gather_into_tensor(out, inputs[rank].clone(), async_op=True)
    # reduce_scatter_tensor, issued before waiting for the first
    pieces = [gen(("async-rs", j), rank, (k,), "float32") for j in range(n)]
    rs_out = torch.empty(k)
    w2 = dist.reduce_scatter_tensor(rs_out, torch.cat(pieces), async_op=True)
    # broadcast and all_gather (list)
    b = gen("async-b", rank, (k,), "int64")
    w3 = dist.broadcast(b, src=n - 1, async_op=True)
    ag = [torch.empty(k) for _ in range(n)]
    w4 = dist.all_gather(ag, inputs[rank].clone(), async_op=True)
    for name, w in (("all_gather", w4), ("broadcast", w3), ("reduce_scatter_tensor", w2),
                    ("all_gather_into_tensor", w1)):
        w.wait()
        if not w.is_completed():
            problems.append(f"{name}: work.is_completed() is False after work.wait()")
    problems += compare(out, torch.cat(inputs), None, "async all_gather_into_tensor")
    problems += check_reduction(rs_out, gen_all(("async-rs", rank), n, (k,), "float32"), "SUM",
                                "async reduce_scatter_tensor")
    problems += compare(b, gen("async-b", n - 1, (k,), "int64"), None, "async broadcast")
    for j in range(n):
        problems += compare(ag[j], inputs[j], None, f"async all_gather output[{j}]")
    # futures
    t = gen("async-f", rank, (k,), "int64")
    v = dist.broadcast(t, src=0, async_op=True).get_future().wait()
    if not (isinstance(v, list) and len(v) == 1 and torch.equal(v[0], t)):
        problems.append(f"broadcast future value {v!r:.200}")
    problems += compare(t, gen("async-f", 0, (k,), "int64"), None, "broadcast via future")
    return problems


@ws_param
def test_async_collectives(backend, world_size):
    harness.check(backend, world_size, _case_async_collectives,
                  gap=expectations.gap(backend, "async_collectives", world_size=world_size))


def _case_coalesced_gather_scatter(ctx):
    """_coalescing_manager around all_gather_into_tensor / reduce_scatter_tensor (FSDP)."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    shapes = [(3,), (0,), (17,), (2, 5)]
    ins = [gen_all(("cag", s), n, s, "float32") for s in shapes]
    outs = [torch.empty((n * s[0],) + s[1:]) for s in shapes]
    try:
        with dist._coalescing_manager(async_ops=True) as cm:
            for o, i in zip(outs, ins):
                dist.all_gather_into_tensor(o, i[rank].clone(), async_op=True)
        cm.wait()
        for s, o, i in zip(shapes, outs, ins):
            problems += compare(o, torch.cat(i), None, f"coalesced all_gather_into_tensor {s}")
    except Exception as e:
        problems.append(f"coalesced all_gather_into_tensor raised {first_line(e)}")
    pieces = [[gen(("crs", s, j), rank, s, "float32") for j in range(n)] for s in shapes]
    rs = [torch.empty(s) for s in shapes]
    try:
        with dist._coalescing_manager(async_ops=True) as cm:
            for o, p in zip(rs, pieces):
                dist.reduce_scatter_tensor(o, torch.cat(p), async_op=True)
        cm.wait()
        for s, o in zip(shapes, rs):
            problems += check_reduction(o, gen_all(("crs", s, rank), n, s, "float32"), "SUM",
                                        f"coalesced reduce_scatter_tensor {s}")
    except Exception as e:
        problems.append(f"coalesced reduce_scatter_tensor raised {first_line(e)}")
    return problems


@ws_param
def test_coalesced_all_gather_reduce_scatter(backend, world_size):
    harness.check(backend, world_size, _case_coalesced_gather_scatter,
                  gap=expectations.gap(backend, "coalesced_gather_scatter",
                                       world_size=world_size))
