"""Bad arguments to every collective torch.distributed offers (issue 5: never hang, never corrupt,
always say who).

Each scenario below makes one bad call: a tensor on the wrong device or sparse, mixed dtypes in
a list, a wrong size or list length, a root/src/dst/peer out of range, splits that do not add
up, an output whose elements share memory (expand()), an unsupported dtype or (op, dtype) pair,
a non-positive per-call timeout. The call must raise ValueError or RuntimeError (not
DistBackendError: that would mean it reached the wire) on the calling rank, with a message that
names the argument at fault (its name as torch.distributed spells it, or its index in a list,
or its bad value), and leave every tensor it was given untouched.

"solo" scenarios make the bad call on ONE rank only (the last); the others do not call at all.
Then every rank runs a good all_reduce (and for point-to-point scenarios, a ring of
isend/irecv) and checks its result. Had the bad call queued or sent anything, that good
collective would pair with it and fail or give a wrong answer: so it passing proves that
nothing moved and nothing is left waiting. "all" scenarios are bad on every rank alike (an
out-of-range root, say) and every rank must raise; the object variants are "all" because
torch's object functions run collectives of their own before the one that is refused.

Some checks are torch's, in its Python layer or its dispatcher, before any backend sees the
call (mixed dtypes, a sparse tensor where no backend kernel exists, sending to oneself): what
counts is what the user sees, so those are here too. A tensor that is ALL on the meta device
never reaches a backend at all: torch registers Meta kernels for the c10d ops that return a
FakeWork (torch/distributed/_meta_registrations.py, for tracing meta models), so such a call
is a local no-op; the "meta" scenario checks exactly that (no error, nothing moved, the group
fine). A meta tensor among CPU ones does reach the backend, which must refuse it.

gloo's deviations are in expectations.py ("bad_args.<scenario>").
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import warnings
from typing import Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
from reference import first_line

WORLD_SIZES = [2, 3]
# How long the good collective after a bad call may take before the group counts as stuck; the
# case bound is above it so that a stuck group is reported by the case, with its problems.
AFTER_TIMEOUT_S = 5.0
CASE_BOUND_S = 15.0
SENTINEL = 7.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    # (world_size, calling rank) -> (the bad call, tensors it must leave untouched,
    #                                regexes that must all match the error message)
    build: Callable
    mode: str = "solo"  # "solo": only the last rank calls; "all": every rank calls
    p2p: bool = False  # also check a ring of sends and receives afterwards
    torch_noop: bool = False  # torch handles the call without the backend (see module doc)


SCENARIOS: Dict[str, Scenario] = {}


def scenario(name: str, mode: str = "solo", p2p: bool = False, torch_noop: bool = False):
    def register(build):
        assert name not in SCENARIOS, name
        SCENARIOS[name] = Scenario(build, mode, p2p, torch_noop)
        return build

    return register


def full(*shape, dtype=torch.float32):
    return torch.full(shape, SENTINEL, dtype=dtype)


def expanded(numel: int) -> torch.Tensor:
    """A tensor whose elements all share one memory location."""
    return torch.full((1,), SENTINEL).expand(numel)


def meta(*shape):
    return torch.empty(shape, device="meta")


def sparse(numel: int) -> torch.Tensor:
    return torch.full((numel,), SENTINEL).to_sparse()


def premul_sum(factor: float):
    return dist._make_nccl_premul_sum(factor)


INDEX = r"(?:\[{i}\]|index {i}\b|tensor {i}\b)"


def at(i: int) -> str:
    return INDEX.format(i=i)


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


# --------------------------------------------------------------------- point to point

@scenario("send.dst_too_big", p2p=True)
def _(n, me):
    return lambda: dist.send(full(4), dst=n), [], [r"dst|destination|rank", rf"\b{n}\b"]


@scenario("send.dst_negative", p2p=True)
def _(n, me):
    return lambda: dist.send(full(4), dst=-1), [], [r"dst|destination|rank", r"-1"]


@scenario("send.to_self", p2p=True)
def _(n, me):
    return lambda: dist.send(full(4), dst=me), [], [r"dst|destination"]


@scenario("send.sparse", p2p=True)
def _(n, me):
    return lambda: dist.send(sparse(4), dst=0), [], [r"sparse|layout"]


@scenario("send.negative_tag", p2p=True)
def _(n, me):
    return lambda: dist.send(full(4), dst=0, tag=-1), [], [r"tag", r"-1|negative|nonnegative"]


@scenario("send.uint16", p2p=True)
def _(n, me):
    return lambda: dist.send(full(4, dtype=torch.uint16), dst=0), [], [r"uint16|scalar type"]


@scenario("recv.src_too_big", p2p=True)
def _(n, me):
    t = full(4)
    return lambda: dist.recv(t, src=n), [t], [r"src|source|rank", rf"\b{n}\b"]


@scenario("recv.overlapping", p2p=True)
def _(n, me):
    t = expanded(4)
    return lambda: dist.recv(t, src=0), [t], [r"tensor", r"share memory|overlap"]


@scenario("isend.dst_too_big", p2p=True)
def _(n, me):
    return lambda: dist.isend(full(4), dst=n), [], [r"dst|destination|rank", rf"\b{n}\b"]


@scenario("irecv.src_too_big", p2p=True)
def _(n, me):
    t = full(4)
    return lambda: dist.irecv(t, src=n), [t], [r"src|source|rank", rf"\b{n}\b"]


@scenario("irecv.overlapping", p2p=True)
def _(n, me):
    t = expanded(4)
    return lambda: dist.irecv(t, src=0), [t], [r"tensor", r"share memory|overlap"]


@scenario("batch_isend_irecv.peer_too_big", p2p=True)
def _(n, me):
    return (lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, full(4), n)]), [],
            [r"dst|destination|rank", rf"\b{n}\b"])


@scenario("batch_isend_irecv.meta", p2p=True)
def _(n, me):
    return lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, meta(4), 0)]), [], [r"meta"]


@scenario("batch_isend_irecv.bad_second_op", p2p=True)
def _(n, me):
    # The first op is good, the second refused: a batch is one call, so the first must not have
    # gone out either (or the peer's next receive from this rank gets it).
    t = full(4)
    ops = [dist.P2POp(dist.isend, full(4), 0), dist.P2POp(dist.irecv, t, n)]
    return lambda: dist.batch_isend_irecv(ops), [t], [r"src|source|rank", rf"\b{n}\b"]


# ---------------------------------------------------------------------------- barrier

@scenario("barrier.timeout_negative")
def _(n, me):
    return lambda: dist.barrier(timeout=datetime.timedelta(seconds=-1)), [], [r"timeout"]


@scenario("barrier.timeout_zero")
def _(n, me):
    return lambda: dist.barrier(timeout=datetime.timedelta(0)), [], [r"timeout"]


# ------------------------------------------------------------------------ object variants

@scenario("broadcast_object_list.src_too_big", mode="all")
def _(n, me):
    return lambda: dist.broadcast_object_list([1, "two"], src=n), [], [r"src|root", rf"\b{n}\b"]


@scenario("gather_object.dst_too_big", mode="all")
def _(n, me):
    return lambda: dist.gather_object({"rank": me}, None, dst=n), [], [r"dst|root", rf"\b{n}\b"]


@scenario("gather_object.list_on_non_dst")
def _(n, me):
    return lambda: dist.gather_object(me, [None] * n, dst=0), [], [r"gather_list"]


@scenario("scatter_object_list.src_too_big", mode="all")
def _(n, me):
    return lambda: dist.scatter_object_list([None], None, src=n), [], [r"src|root", rf"\b{n}\b"]


@scenario("scatter_object_list.empty_output")
def _(n, me):
    return (lambda: dist.scatter_object_list([], list(range(n)), src=me), [],
            [r"scatter_object_output_list"])


# ------------------------------------------------------------------------------- the case

def _wait(start: Callable, what: str) -> List[str]:
    """Start a work and wait for it, bounded; a problem if either fails."""
    try:
        start().wait(timeout=datetime.timedelta(seconds=AFTER_TIMEOUT_S))
    except Exception as e:
        return [f"{what} after the bad call failed: {first_line(e)}"]
    return []


def _group_still_works(rank: int, n: int, p2p: bool) -> List[str]:
    """A good all_reduce (and a ring of sends) on every rank, each wait bounded."""
    t = torch.full((5,), float(rank + 1))
    problems = _wait(lambda: dist.all_reduce(t, async_op=True), "all_reduce")
    if problems:
        return problems
    want = n * (n + 1) / 2
    if not bool((t == want).all()):
        return [f"all_reduce after the bad call gave {t.tolist()}, expected {want}"]
    if p2p:
        got = torch.zeros(6)
        try:
            recv = dist.irecv(got, src=(rank - 1) % n)
            send = dist.isend(torch.full((6,), 10.0 * rank + 1), dst=(rank + 1) % n)
        except Exception as e:
            return [f"a ring isend/irecv after the bad call failed: {first_line(e)}"]
        problems = _wait(lambda: send, "a ring isend") + _wait(lambda: recv, "a ring irecv")
        if problems:
            return problems
        expect = 10.0 * ((rank - 1) % n) + 1
        if not bool((got == expect).all()):
            return [f"the ring receive after the bad call got {got.tolist()}, expected {expect} "
                    "(a stale message from the bad call?)"]
    return []


def _case_bad(ctx, name: str) -> List[str]:
    sc = SCENARIOS[name]
    n, rank = ctx.world_size, ctx.rank
    problems: List[str] = []
    if sc.mode == "all" or rank == n - 1:
        call, watched, names = sc.build(n, rank)
        before = [w.clone() for w in watched]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = call()
            for work in result if isinstance(result, list) else [result]:
                if hasattr(work, "wait"):  # an async form: its error may come at wait()
                    work.wait(timeout=datetime.timedelta(seconds=AFTER_TIMEOUT_S))
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            if sc.torch_noop:
                problems.append(f"raised, where torch's Meta kernel makes the call a local no-op: "
                                f"{first_line(e)}")
            elif isinstance(e, dist.DistBackendError) or not isinstance(e, (ValueError, RuntimeError)):
                problems.append(f"raised {type(e).__name__}, not a ValueError or RuntimeError at the "
                                f"call: {first_line(e)}")
            else:
                missing = [p for p in names if not re.search(p, text, re.I | re.S)]
                if missing:
                    problems.append(f"the error does not name the argument at fault (wanted "
                                    f"{' and '.join(map(repr, missing))}): {first_line(e)}")
        else:
            if not sc.torch_noop:
                problems.append("the bad call was accepted (no error)")
        for i, (w, b) in enumerate(zip(watched, before)):
            if not torch.equal(w, b):
                problems.append(f"the bad call changed the tensor it was given (watched tensor {i})")
    problems += _group_still_works(rank, n, sc.p2p)
    return [f"{name}: {p}" for p in problems]


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"ws{w}")
def test_bad_argument(backend, world_size, name):
    gap = expectations.gap(backend, f"bad_args.{name}", world_size=world_size)
    if gap is not None and gap.skip:
        pytest.skip(str(gap))
    try:
        found = harness.problems(harness.run(backend, world_size, _case_bad, name, timeout=CASE_BOUND_S))
    except harness.CaseFailure as failure:  # a rank raised outside the checks, died or hung
        found = [f"{name}: the case failed: {failure}"]  # (the harness killed the pool)
    if found:  # whatever happened, do not hand a group that may be out of step to the next test
        harness.discard_pool(backend, world_size)
    harness.conclude(found, gap, f"{backend} world_size={world_size}")
