"""Bad arguments to point-to-point calls, barrier and the object variants (issue 5: never hang,
never corrupt, always say who). What each scenario checks, and how, is said in bad_arguments.py."""

from __future__ import annotations

import datetime
from typing import Dict

import pytest
import torch
import torch.distributed as dist

import bad_arguments
from bad_arguments import WORLD_SIZES, Scenario, expanded, full, meta, sparse

SCENARIOS: Dict[str, Scenario] = {}
scenario = bad_arguments.registrar(SCENARIOS)


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


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"ws{w}")
def test_bad_argument(backend, world_size, name):
    bad_arguments.check(backend, world_size, __name__, name)
