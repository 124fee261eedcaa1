"""Bad arguments to every collective (issue 5: never hang, never corrupt, always say who):
all_reduce, reduce, broadcast, the gathers, scatter, the reduce_scatters and the all_to_alls.
What each scenario checks, and how, is said in bad_arguments.py."""

from __future__ import annotations

import datetime
import warnings
from typing import Dict

import pytest
import torch
import torch.distributed as dist

import bad_arguments
from bad_arguments import WORLD_SIZES, Scenario, at, expanded, full, meta, premul_sum, sparse

SCENARIOS: Dict[str, Scenario] = {}
scenario = bad_arguments.registrar(SCENARIOS)


# --------------------------------------------------------------------------- all_reduce

@scenario("all_reduce.sparse_max")
def _(n, me):
    t = sparse(4)  # sparse tensors are all-reduced with SUM only
    return lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), [], [r"SUM"]


@scenario("all_reduce.meta", torch_noop=True)
def _(n, me):
    t = meta(4)
    return lambda: dist.all_reduce(t), [], []


@scenario("all_reduce.band_float")
def _(n, me):
    t = full(4)
    return lambda: dist.all_reduce(t, op=dist.ReduceOp.BAND), [t], [r"BAND", r"float"]


@scenario("all_reduce.avg_int")
def _(n, me):
    t = full(4, dtype=torch.int32)
    return lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG), [t], [r"AVG", r"int"]


@scenario("all_reduce.premul_sum_int")
def _(n, me):
    t = full(4, dtype=torch.int64)
    return lambda: dist.all_reduce(t, op=premul_sum(2.0)), [t], [r"PREMUL_SUM", r"int|long"]


@scenario("all_reduce.uint16")
def _(n, me):
    t = full(4, dtype=torch.uint16)
    return lambda: dist.all_reduce(t), [t], [r"uint16|scalar type"]


@scenario("all_reduce.complex_max")
def _(n, me):
    t = full(4, dtype=torch.complex64)
    return lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), [t], [r"MAX", r"complex"]


@scenario("all_reduce.overlapping")
def _(n, me):
    t = expanded(4)
    return lambda: dist.all_reduce(t), [t], [r"tensor", r"share memory|overlap"]


@scenario("all_reduce.timeout_negative", p2p=False)
def _(n, me):
    # torch's all_reduce takes no timeout; the ProcessGroup method does, with AllreduceOptions.
    t = full(4)

    def call():
        opts = dist.AllreduceOptions()
        opts.timeout = datetime.timedelta(seconds=-1)
        dist.group.WORLD.allreduce([t], opts).wait()

    return call, [t], [r"timeout"]


# ------------------------------------------------------------------ all_reduce_coalesced

@scenario("all_reduce_coalesced.mixed_dtypes")
def _(n, me):
    ts = [full(2), full(2, dtype=torch.float64)]
    return lambda: dist.all_reduce_coalesced(ts), ts, [r"dtype"]


@scenario("all_reduce_coalesced.meta_among_cpu")
def _(n, me):
    ts = [full(2), meta(2)]
    return lambda: dist.all_reduce_coalesced(ts), ts[:1], [r"meta"]


@scenario("all_reduce_coalesced.overlapping")
def _(n, me):
    ts = [full(2), expanded(3)]
    return lambda: dist.all_reduce_coalesced(ts), ts, [at(1), r"share memory|overlap"]


@scenario("all_reduce_coalesced.empty")
def _(n, me):
    return lambda: dist.all_reduce_coalesced([]), [], [r"no tensor|empty|at least one"]


# ----------------------------------------------------------------------------- reduce

@scenario("reduce.dst_too_big", mode="all")
def _(n, me):
    t = full(4)
    return lambda: dist.reduce(t, dst=n), [t], [r"dst|root", rf"\b{n}\b"]


@scenario("reduce.dst_negative", mode="all")
def _(n, me):
    t = full(4)
    return lambda: dist.reduce(t, dst=-1), [t], [r"dst|root", r"-1"]


@scenario("reduce.band_float")
def _(n, me):
    t = full(4)
    return lambda: dist.reduce(t, dst=0, op=dist.ReduceOp.BAND), [t], [r"BAND", r"float"]


@scenario("reduce.overlapping")
def _(n, me):
    t = expanded(4)
    return lambda: dist.reduce(t, dst=me), [t], [r"tensor", r"share memory|overlap"]


# -------------------------------------------------------------------------- broadcast

@scenario("broadcast.src_too_big", mode="all")
def _(n, me):
    t = full(4)
    return lambda: dist.broadcast(t, src=n), [t], [r"src|root", rf"\b{n}\b"]


@scenario("broadcast.src_negative", mode="all")
def _(n, me):
    t = full(4)
    return lambda: dist.broadcast(t, src=-1), [t], [r"src|root", r"-1"]


@scenario("broadcast.sparse")
def _(n, me):
    t = sparse(4)
    return lambda: dist.broadcast(t, src=0), [], [r"sparse|layout"]


@scenario("broadcast.overlapping")
def _(n, me):
    t = expanded(4)
    return lambda: dist.broadcast(t, src=0), [t], [r"tensor", r"share memory|overlap"]


# ------------------------------------------------------------------------- all_gather

@scenario("all_gather.list_too_short")
def _(n, me):
    out = [full(4) for _ in range(n - 1)]
    return lambda: dist.all_gather(out, full(4)), out, [r"tensor_list|output.*list", rf"\b{n - 1}\b"]


@scenario("all_gather.list_too_long")
def _(n, me):
    out = [full(4) for _ in range(n + 1)]
    return lambda: dist.all_gather(out, full(4)), out, [r"tensor_list|output.*list", rf"\b{n + 1}\b"]


@scenario("all_gather.mixed_dtypes")
def _(n, me):
    out = [full(4) for _ in range(n - 1)] + [full(4, dtype=torch.float64)]
    return lambda: dist.all_gather(out, full(4)), out, [r"dtype|type"]


@scenario("all_gather.wrong_size")
def _(n, me):
    out = [full(4) for _ in range(n - 1)] + [full(5)]
    return lambda: dist.all_gather(out, full(4)), out, [at(n - 1), r"size|elements"]


@scenario("all_gather.meta_among_cpu")
def _(n, me):
    out = [full(4) for _ in range(n - 1)] + [meta(4)]
    return lambda: dist.all_gather(out, full(4)), out[:-1], [at(n - 1), r"meta"]


@scenario("all_gather.sparse_input")
def _(n, me):
    out = [full(4) for _ in range(n)]
    t = sparse(4)
    return lambda: dist.all_gather(out, t), out, [r"sparse|layout"]


@scenario("all_gather.overlapping")
def _(n, me):
    out = [full(4) for _ in range(n - 1)] + [expanded(4)]
    return lambda: dist.all_gather(out, full(4)), out, [at(n - 1), r"share memory|overlap"]


# ------------------------------------------------------------- all_gather_into_tensor

def _gather_into(out, inp):
    with warnings.catch_warnings():  # deprecated in torch 2.13 in favour of all_gather_single
        warnings.simplefilter("ignore")
        return dist.all_gather_into_tensor(out, inp)


@scenario("all_gather_into_tensor.wrong_size")
def _(n, me):
    out = full(4 * n + 1)
    return lambda: _gather_into(out, full(4)), [out], [r"output_tensor|output|size", r"size|elements"]


@scenario("all_gather_into_tensor.dtype_mismatch")
def _(n, me):
    out = full(4 * n, dtype=torch.float64)
    return lambda: _gather_into(out, full(4)), [out], [r"dtype|type"]


@scenario("all_gather_into_tensor.sparse_input")
def _(n, me):
    out = full(4 * n)
    t = sparse(4)
    return lambda: _gather_into(out, t), [out], [r"sparse|layout"]


@scenario("all_gather_into_tensor.overlapping")
def _(n, me):
    out = expanded(4 * n)
    return lambda: _gather_into(out, full(4)), [out], [r"output", r"share memory|overlap"]


# --------------------------------------------------------------- all_gather_coalesced

def _gather_coalesced(outs, ins):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dist.all_gather_coalesced(outs, ins)


@scenario("all_gather_coalesced.too_few_lists")
def _(n, me):
    outs = [[full(2)] for _ in range(n - 1)]
    return (lambda: _gather_coalesced(outs, [full(2)]), [t for o in outs for t in o],
            [r"output_tensor_lists|output lists"])


@scenario("all_gather_coalesced.inner_list_length")
def _(n, me):
    outs = [[full(2), full(2)] for _ in range(n)]
    return (lambda: _gather_coalesced(outs, [full(2)]), [t for o in outs for t in o],
            [r"output_tensor_lists\[0\]|output size", r"\b2\b"])


@scenario("all_gather_coalesced.dtype_mismatch")
def _(n, me):
    outs = [[full(2)] for _ in range(n - 1)] + [[full(2, dtype=torch.int64)]]
    return (lambda: _gather_coalesced(outs, [full(2)]), [t for o in outs for t in o],
            [r"dtype|type", r"long|int64"])


# ----------------------------------------------------------------------------- gather

@scenario("gather.dst_too_big", mode="all")
def _(n, me):
    return lambda: dist.gather(full(4), None, dst=n), [], [r"dst|root", rf"\b{n}\b"]


@scenario("gather.list_too_short")
def _(n, me):
    out = [full(4) for _ in range(n - 1)]
    return lambda: dist.gather(full(4), out, dst=me), out, [r"gather_list|output list", rf"\b{n - 1}\b"]


@scenario("gather.mixed_dtypes")
def _(n, me):
    out = [full(4) for _ in range(n - 1)] + [full(4, dtype=torch.int32)]
    return lambda: dist.gather(full(4), out, dst=me), out, [r"dtype|type"]


@scenario("gather.wrong_size")
def _(n, me):
    out = [full(4) for _ in range(n - 1)] + [full(3)]
    return lambda: dist.gather(full(4), out, dst=me), out, [at(n - 1), r"size|elements"]


@scenario("gather.list_on_non_dst")
def _(n, me):
    out = [full(4) for _ in range(n)]
    return lambda: dist.gather(full(4), out, dst=0), out, [r"gather_list"]


@scenario("gather.overlapping")
def _(n, me):
    out = [full(4) for _ in range(n - 1)] + [expanded(4)]
    return lambda: dist.gather(full(4), out, dst=me), out, [at(n - 1), r"share memory|overlap"]


# ---------------------------------------------------------------------------- scatter

@scenario("scatter.src_too_big", mode="all")
def _(n, me):
    t = full(4)
    return lambda: dist.scatter(t, None, src=n), [t], [r"src|root", rf"\b{n}\b"]


@scenario("scatter.list_too_short")
def _(n, me):
    t, inp = full(4), [full(4) for _ in range(n - 1)]
    return lambda: dist.scatter(t, inp, src=me), [t], [r"scatter_list|input list", rf"\b{n - 1}\b"]


@scenario("scatter.mixed_dtypes")
def _(n, me):
    t, inp = full(4), [full(4) for _ in range(n - 1)] + [full(4, dtype=torch.int32)]
    return lambda: dist.scatter(t, inp, src=me), [t], [r"dtype|type"]


@scenario("scatter.wrong_size")
def _(n, me):
    t, inp = full(4), [full(4) for _ in range(n - 1)] + [full(5)]
    return lambda: dist.scatter(t, inp, src=me), [t], [at(n - 1), r"size|elements"]


@scenario("scatter.list_on_non_src")
def _(n, me):
    t, inp = full(4), [full(4) for _ in range(n)]
    return lambda: dist.scatter(t, inp, src=0), [t], [r"scatter_list"]


@scenario("scatter.overlapping_output")
def _(n, me):
    t = expanded(4)
    return lambda: dist.scatter(t, None, src=0), [t], [r"tensor|output", r"share memory|overlap"]


# --------------------------------------------------------------------- reduce_scatter

@scenario("reduce_scatter.list_too_short")
def _(n, me):
    out, inp = full(4), [full(4) for _ in range(n - 1)]
    return lambda: dist.reduce_scatter(out, inp), [out], [r"input_list|input.*list", r"size|\b%d\b" % (n - 1)]


@scenario("reduce_scatter.mixed_dtypes")
def _(n, me):
    out, inp = full(4), [full(4) for _ in range(n - 1)] + [full(4, dtype=torch.float64)]
    return lambda: dist.reduce_scatter(out, inp), [out], [r"dtype|type"]


@scenario("reduce_scatter.wrong_size")
def _(n, me):
    out, inp = full(4), [full(5) for _ in range(n)]
    return lambda: dist.reduce_scatter(out, inp), [out], [at(me), r"size|elements"]


@scenario("reduce_scatter.band_float")
def _(n, me):
    out, inp = full(4), [full(4) for _ in range(n)]
    return lambda: dist.reduce_scatter(out, inp, op=dist.ReduceOp.BAND), [out], [r"BAND", r"float"]


@scenario("reduce_scatter.overlapping")
def _(n, me):
    out, inp = expanded(4), [full(4) for _ in range(n)]
    return lambda: dist.reduce_scatter(out, inp), [out], [r"output", r"share memory|overlap"]


# -------------------------------------------------------------- reduce_scatter_tensor

def _rs_tensor(out, inp, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dist.reduce_scatter_tensor(out, inp, **kw)


@scenario("reduce_scatter_tensor.wrong_size")
def _(n, me):
    out = full(4)
    return lambda: _rs_tensor(out, full(4 * n + 1)), [out], [r"input", r"size|elements|\d+ vs\. \d+"]


@scenario("reduce_scatter_tensor.dtype_mismatch")
def _(n, me):
    out = full(4)
    return lambda: _rs_tensor(out, full(4 * n, dtype=torch.float64)), [out], [r"dtype|type", r"double|float64"]


@scenario("reduce_scatter_tensor.band_float")
def _(n, me):
    out = full(4)
    return lambda: _rs_tensor(out, full(4 * n), op=dist.ReduceOp.BAND), [out], [r"BAND", r"float"]


@scenario("reduce_scatter_tensor.overlapping")
def _(n, me):
    out = expanded(4)
    return lambda: _rs_tensor(out, full(4 * n)), [out], [r"output", r"share memory|overlap"]


# ------------------------------------------------------------------------- all_to_all

@scenario("all_to_all.input_list_too_short")
def _(n, me):
    out = [full(2) for _ in range(n)]
    return (lambda: dist.all_to_all(out, [full(2) for _ in range(n - 1)]), out,
            [r"input_tensor_list|input tensor list", rf"\b{n - 1}\b"])


@scenario("all_to_all.output_list_too_short")
def _(n, me):
    out = [full(2) for _ in range(n - 1)]
    return (lambda: dist.all_to_all(out, [full(2) for _ in range(n)]), out,
            [r"output_tensor_list|output tensor list", rf"\b{n - 1}\b"])


@scenario("all_to_all.mixed_dtypes")
def _(n, me):
    out = [full(2) for _ in range(n)]
    inp = [full(2) for _ in range(n - 1)] + [full(2, dtype=torch.int32)]
    return lambda: dist.all_to_all(out, inp), out, [r"dtype|type"]


@scenario("all_to_all.own_block_size")
def _(n, me):
    out = [full(2) for _ in range(n)]
    inp = [full(3) if i == me else full(2) for i in range(n)]
    return lambda: dist.all_to_all(out, inp), out, [at(me), r"size|bytes"]


@scenario("all_to_all.overlapping")
def _(n, me):
    out = [full(2) for _ in range(n - 1)] + [expanded(2)]
    return lambda: dist.all_to_all(out, [full(2) for _ in range(n)]), out, [at(n - 1), r"share memory|overlap"]


# ------------------------------------------------------------------ all_to_all_single

@scenario("all_to_all_single.splits_sum")
def _(n, me):
    out = full(2 * n)
    return (lambda: dist.all_to_all_single(out, full(2 * n), output_split_sizes=[2] * n,
                                           input_split_sizes=[2] * (n - 1) + [3]), [out],
            [r"input_split_sizes|split", r"sum|size|match"])


@scenario("all_to_all_single.splits_length")
def _(n, me):
    out = full(2 * n)
    return (lambda: dist.all_to_all_single(out, full(2 * n), output_split_sizes=[2] * n,
                                           input_split_sizes=[2] * (n - 1)), [out],
            [r"input_split_sizes|splits", r"\b%d\b|group size" % (n - 1)])


@scenario("all_to_all_single.negative_split")
def _(n, me):
    out = full(2 * n)
    return (lambda: dist.all_to_all_single(out, full(2 * n), output_split_sizes=[2] * n,
                                           input_split_sizes=[-1, 2 * n + 1] + [0] * (n - 2)), [out],
            [r"input_split_sizes|split|inLength", r"-1|\[0\]|negative|inLength"])


@scenario("all_to_all_single.not_divisible")
def _(n, me):
    out = full(2 * n + 1)
    return lambda: dist.all_to_all_single(out, full(2 * n + 1)), [out], [r"input|output", r"divide|split"]


@scenario("all_to_all_single.dtype_mismatch")
def _(n, me):
    out = full(2 * n)
    return lambda: dist.all_to_all_single(out, full(2 * n, dtype=torch.int32)), [out], [r"dtype|type"]


@scenario("all_to_all_single.overlapping")
def _(n, me):
    out = expanded(2 * n)
    return lambda: dist.all_to_all_single(out, full(2 * n)), [out], [r"output", r"share memory|overlap"]


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"ws{w}")
def test_bad_argument(backend, world_size, name):
    bad_arguments.check(backend, world_size, __name__, name)
