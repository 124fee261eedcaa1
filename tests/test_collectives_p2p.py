"""Point to point: send/recv around a ring (every dtype, non-contiguous), tags, any source,
batch_isend_irecv."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
from collective_helpers import attempt, group_still_works, strided
from reference import DTYPE_NAMES, compare, dtype_of, first_line, fmt_shape, gen

# Every transport keeps these promises: they also run over OFI (conftest.py).
TRANSPORT_CONTRACT = True

ws_p2p = pytest.mark.parametrize("world_size", [2, 3, 4, 8], ids=lambda w: f"ws{w}")
dtype_param = pytest.mark.parametrize("dtype", DTYPE_NAMES)


# ------------------------------------------------------------------------------ point to point


def _case_p2p_ring(ctx, dtype, noncontig=False):
    """Blocking and non-blocking send/recv around the ring, every shape.  noncontig: strided
    tensors; a backend may refuse them with an error that says "contiguous" (as gloo and
    NCCL do; the group must stay usable), or must deliver the right data."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for shape in [(0,), (), (7,), (1031,), (2, 3, 5)] if not noncontig else [(9,), (3, 4)]:
        mine = gen(("p2p", shape), rank, shape, dtype)
        expect = gen(("p2p", shape), prv, shape, dtype)
        label = f"send/recv ring {dtype} shape={fmt_shape(shape)}"
        # blocking: even ranks send first (no deadlock for any n, incl. odd n)
        buf = torch.zeros(shape, dtype=dtype_of(dtype))
        src_t = strided(mine) if noncontig else mine.clone()
        if noncontig:
            buf = strided(buf)

        def blocking():
            if rank % 2 == 0:
                dist.send(src_t, nxt)
                dist.recv(buf, prv)
            else:
                dist.recv(buf, prv)
                dist.send(src_t, nxt)

        if n % 2 == 1 and n > 1:
            # odd ring: the last (even) rank sends to rank 0 (even): use isend to avoid a cycle
            def blocking():  # noqa: F811
                w = dist.isend(src_t, nxt)
                dist.recv(buf, prv)
                w.wait()

        try:
            blocking()
        except Exception as e:
            if noncontig and "contiguous" in str(e).lower():
                dist.barrier()
                return group_still_works()
            return problems + [f"{label} (blocking): raised {first_line(e)}"]
        problems += compare(buf, expect, None, label + " (blocking)")
        buf2 = torch.zeros(shape, dtype=dtype_of(dtype))
        if noncontig:
            buf2 = strided(buf2)

        def nonblocking():
            r = dist.irecv(buf2, prv)
            s = dist.isend(src_t, nxt)
            s.wait()
            r.wait()

        if not attempt(nonblocking, label + " (isend/irecv)", problems):
            return problems
        problems += compare(buf2, expect, None, label + " (isend/irecv)")
    return problems


@dtype_param
@ws_p2p
def test_send_recv_ring(backend, world_size, dtype):
    harness.check(backend, world_size, _case_p2p_ring, dtype,
                  gap=expectations.gap(backend, "send_recv", dtype, world_size=world_size))


@ws_p2p
def test_send_recv_noncontiguous(backend, world_size):
    harness.check(backend, world_size, _case_p2p_ring, "float32", True,
                  gap=expectations.gap(backend, "send_recv.noncontig", "float32",
                                       world_size=world_size))


def _case_tags(ctx):
    """Pairs (2k -> 2k+1): three messages with different tags and sizes, received in the
    opposite order of sending."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    tags = [1, 2, 70000]
    msgs = {tag: gen(("tag", tag), rank - (rank % 2), (tag % 13 + 3 * i,), "float32")
            for i, tag in enumerate(tags)}
    if rank % 2 == 0 and rank + 1 < n:
        works = [dist.isend(msgs[tag].clone(), rank + 1, tag=tag) for tag in tags]
        for w in works:
            w.wait()
    elif rank % 2 == 1:
        bufs = {tag: torch.zeros_like(msgs[tag]) for tag in tags}
        works = [(tag, dist.irecv(bufs[tag], rank - 1, tag=tag)) for tag in reversed(tags)]
        for tag, w in works:
            w.wait()
            problems += compare(bufs[tag], msgs[tag], None, f"message with tag {tag}")
    dist.barrier()
    return problems


@ws_p2p
def test_send_recv_tags(backend, world_size):
    harness.check(backend, world_size, _case_tags)


def _case_recv_any_source(ctx):
    """Rank 0 receives one message from every other rank with src=None (any order) and must
    be told the right source; then once more with irecv."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.zeros(4, dtype=torch.int64)
            src = dist.recv(t)  # src=None: any source
            sender = int(t[0])
            if src != sender:
                problems.append(f"recv(src=None) reported source {src}, message is from "
                                f"rank {sender}")
            if t.tolist() != [sender, sender * 10, sender * 100, 7]:
                problems.append(f"recv(src=None) got {t.tolist()} from rank {sender}")
            seen.add(sender)
        if seen != set(range(1, n)):
            problems.append(f"received from {sorted(seen)}, expected every rank 1..{n - 1}")
    else:
        time.sleep(0.02 * ((n - rank) % n))  # vary arrival order
        dist.send(torch.tensor([rank, rank * 10, rank * 100, 7]), 0)
    dist.barrier()
    return problems


@ws_p2p
def test_recv_any_source(backend, world_size):
    harness.check(backend, world_size, _case_recv_any_source)


def _case_batch_isend_irecv(ctx, dtype):
    """Ring exchange in both directions with batch_isend_irecv."""
    n, rank, problems = ctx.world_size, ctx.rank, []
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for shape in [(5,), (1031,), (0,)]:
        to_next = gen(("batch", "fwd", shape), rank, shape, dtype)
        to_prev = gen(("batch", "bwd", shape), rank, shape, dtype)
        from_prev = torch.zeros(shape, dtype=dtype_of(dtype))
        from_next = torch.zeros(shape, dtype=dtype_of(dtype))
        ops = [dist.P2POp(dist.isend, to_next, nxt), dist.P2POp(dist.irecv, from_prev, prv),
               dist.P2POp(dist.isend, to_prev, prv), dist.P2POp(dist.irecv, from_next, nxt)]
        label = f"batch_isend_irecv {dtype} shape={fmt_shape(shape)}"

        def go():
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        if not attempt(go, label, problems):
            return problems
        problems += compare(from_prev, gen(("batch", "fwd", shape), prv, shape, dtype), None,
                            label + " from previous rank")
        problems += compare(from_next, gen(("batch", "bwd", shape), nxt, shape, dtype), None,
                            label + " from next rank")
    return problems


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16", "bool"])
@ws_p2p
def test_batch_isend_irecv(backend, world_size, dtype):
    harness.check(backend, world_size, _case_batch_isend_irecv, dtype,
                  gap=expectations.gap(backend, "batch_isend_irecv", dtype,
                                       world_size=world_size))
