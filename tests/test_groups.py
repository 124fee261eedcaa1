"""Process groups: subgroups with the backend, several groups interleaved, the "cpu:<backend>"
device map, init_method variants (tcp://, file://, env://, explicit TCPStore) on fresh
processes, and destroy_process_group followed by a new init in the same process."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
from reference import check_reduction, compare, first_line, gen, gen_all


def _check_group_collectives(ctx, g, members, label) -> list:
    """all_reduce, broadcast, all_gather, barrier on group g whose global ranks are members."""
    problems = []
    rank = ctx.rank
    if rank not in members:
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            problems.append(f"{label}: non-member rank {rank} got {g!r}")
        return problems
    m = len(members)
    grank = dist.get_rank(g)
    if grank != members.index(rank) or dist.get_world_size(g) != m:
        problems.append(f"{label}: group rank/size {grank}/{dist.get_world_size(g)}, expected "
                        f"{members.index(rank)}/{m}")
    if dist.get_process_group_ranks(g) != members:
        problems.append(f"{label}: get_process_group_ranks {dist.get_process_group_ranks(g)}")
    for i, gr in enumerate(members):
        if dist.get_global_rank(g, i) != gr:
            problems.append(f"{label}: get_global_rank({i}) = {dist.get_global_rank(g, i)}")
    try:
        # all_reduce: every member contributes its input (by global rank)
        inputs = [gen((label, "ar"), r, (37,), "float32") for r in members]
        t = gen((label, "ar"), rank, (37,), "float32")
        dist.all_reduce(t, group=g)
        problems += check_reduction(t, inputs, "SUM", f"{label}: all_reduce")
        ti = torch.tensor([rank + 1] * 5)
        dist.all_reduce(ti, op=dist.ReduceOp.MAX, group=g)
        problems += compare(ti, torch.tensor([max(members) + 1] * 5), None, f"{label}: MAX")
        # broadcast from the last member (src is a GLOBAL rank)
        src = members[-1]
        b = gen((label, "b"), rank, (11,), "int64")
        dist.broadcast(b, src=src, group=g)
        problems += compare(b, gen((label, "b"), src, (11,), "int64"), None,
                            f"{label}: broadcast src={src}")
        # all_gather in group order
        outs = [torch.empty(6) for _ in members]
        dist.all_gather(outs, gen((label, "ag"), rank, (6,), "float32"), group=g)
        for i, r in enumerate(members):
            problems += compare(outs[i], gen((label, "ag"), r, (6,), "float32"), None,
                                f"{label}: all_gather[{i}]")
        dist.barrier(group=g)
    except Exception as e:
        problems.append(f"{label}: raised {first_line(e)}")
    return problems


def _case_subgroups(ctx):
    n = ctx.world_size
    specs = {
        "even ranks": list(range(0, n, 2)),
        "odd ranks": list(range(1, n, 2)),
        "[0, 2]": [0, 2],
        "single rank (last)": [n - 1],
        "all ranks, listed in reverse": list(range(n)),
    }
    groups = {}
    for label, members in specs.items():  # every rank creates every group, in one order
        ranks = members if "reverse" not in label else list(reversed(members))
        groups[label] = ctx.new_group(ranks)
    problems = []
    for label, members in specs.items():
        problems += _check_group_collectives(ctx, groups[label], members, label)
    # the default group still works after all that
    problems += _check_group_collectives(ctx, dist.group.WORLD, list(range(n)), "default group")
    for label, g in groups.items():
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    return problems


@pytest.mark.parametrize("world_size", [3, 4, 8], ids=lambda w: f"ws{w}")
def test_subgroups(backend, world_size):
    harness.check(backend, world_size, _case_subgroups)


def _case_interleaved(ctx, rounds=6):
    """Several groups alive at once; async collectives issued on them interleaved (each group
    in the same order on all its members, but groups in different orders on different ranks),
    waited in reverse order."""
    n, rank = ctx.world_size, ctx.rank
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    g_all = ctx.new_group(list(range(n)))
    g_even = ctx.new_group(evens)
    g_odd = ctx.new_group(odds) if odds else None
    mine_g, mine_m = (g_even, evens) if rank % 2 == 0 else (g_odd, odds)
    pending = []  # (work, tensor, inputs, label)
    for i in range(rounds):
        key = ("inter", i)
        t1 = gen(key + ("sub",), rank, (100 + i,), "float32")
        w1 = dist.all_reduce(t1, group=mine_g, async_op=True)
        pending.append((w1, t1, [gen(key + ("sub",), r, (100 + i,), "float32") for r in mine_m],
                        f"round {i} subgroup {mine_m}"))
        t2 = gen(key + ("all",), rank, (257,), "float32")
        w2 = dist.all_reduce(t2, group=g_all, async_op=True)
        pending.append((w2, t2, gen_all(key + ("all",), n, (257,), "float32"),
                        f"round {i} new group of all ranks"))
        t3 = gen(key + ("world",), rank, (3,), "float32")
        w3 = dist.all_reduce(t3, async_op=True)
        pending.append((w3, t3, gen_all(key + ("world",), n, (3,), "float32"),
                        f"round {i} default group"))
    problems = []
    for w, t, inputs, label in reversed(pending):
        w.wait()
        problems += check_reduction(t, inputs, "SUM", label)
    for g in (g_all, mine_g):
        dist.destroy_process_group(g)
    return problems


@pytest.mark.parametrize("world_size", [2, 3, 4, 8], ids=lambda w: f"ws{w}")
def test_groups_interleaved(backend, world_size):
    harness.check(backend, world_size, _case_interleaved)


def _case_device_map(ctx):
    """new_group(backend="cpu:<backend>") for all ranks and for a subset."""
    n = ctx.world_size
    spec = f"cpu:{ctx.backend}"
    g = dist.new_group(backend=spec)
    problems = _check_group_collectives(ctx, g, list(range(n)), f"new_group(backend={spec!r})")
    sub = [0, n - 1] if n > 1 else [0]
    g2 = dist.new_group(ranks=sub, backend=spec)
    problems += _check_group_collectives(ctx, g2, sub, f"new_group({sub}, backend={spec!r})")
    dist.destroy_process_group(g)
    if g2 != dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(g2)
    return problems


@pytest.mark.parametrize("world_size", [1, 2, 3], ids=lambda w: f"ws{w}")
def test_device_map_group(backend, world_size):
    harness.check(backend, world_size, _case_device_map)


# ------------------------------------------------------------------ fresh processes


def _case_after_init(ctx):
    """Runs on a one-off job whose harness did init_process_group with a given init."""
    problems = []
    if not dist.is_initialized():
        return ["not initialised"]
    be = str(dist.get_backend())
    if ctx.backend not in be:
        problems.append(f"dist.get_backend() = {be!r}, expected {ctx.backend!r}")
    if dist.get_rank() != ctx.rank or dist.get_world_size() != ctx.world_size:
        problems.append(f"rank/size {dist.get_rank()}/{dist.get_world_size()}")
    problems += _check_group_collectives(ctx, dist.group.WORLD, list(range(ctx.world_size)),
                                         f"init={ctx.spec.init}")
    return problems


@pytest.mark.parametrize("init", ["file", "tcp", "env", "store"])
def test_init_methods(backend, init):
    """file://, tcp://, env:// and an explicit TCPStore, each on fresh processes."""
    harness.conclude(harness.problems(harness.run_job(backend, 2, _case_after_init, init=init,
                                                      timeout=60)),
                     where=f"{backend} init={init}")


def _case_destroy_reinit(ctx):
    """init -> use -> destroy, three times in one process, with different init methods and
    the "cpu:<backend>" spelling; subgroups work after re-initialisation."""
    problems = []
    plan = [("file", ctx.backend, {"tag": "-a"}),
            ("tcp", f"cpu:{ctx.backend}", {"port": ctx.rdv["ports"][1]}),
            ("file", ctx.backend, {"tag": "-b"})]
    for i, (init, be, kw) in enumerate(plan):
        label = f"init #{i} ({init}, backend={be!r})"
        try:
            ctx.init_process_group(init=init, backend=be, **kw)
        except Exception as e:
            return problems + [f"{label}: init raised {first_line(e)}"]
        problems += _check_group_collectives(ctx, dist.group.WORLD, list(range(ctx.world_size)),
                                             label)
        g = ctx.new_group(list(range(ctx.world_size)))
        problems += _check_group_collectives(ctx, g, list(range(ctx.world_size)),
                                             label + " new_group")
        dist.destroy_process_group()
        if dist.is_initialized():
            problems.append(f"{label}: still initialised after destroy_process_group()")
    return problems


def test_destroy_and_reinit(backend):
    harness.conclude(harness.problems(harness.run_job(backend, 2, _case_destroy_reinit,
                                                      timeout=90)),
                     where=f"{backend} destroy/re-init")


def _case_timeout(ctx, group_timeout_s=3.0, late_s=8.0):
    """Ranks 0..n-2 all_reduce on a group with a short timeout; the last rank never joins
    (it sleeps, then returns).  The others must get an error, within the timeout plus some
    slack, that is a DistBackendError, says it timed out and names the collective - never a
    hang (DESIGN.md, "Behaviour users count on")."""
    import datetime

    g = ctx.new_group(list(range(ctx.world_size)),
                      timeout=datetime.timedelta(seconds=group_timeout_s))
    if ctx.rank == ctx.world_size - 1:
        time.sleep(late_s)
        return []
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000), group=g)
    except Exception as e:
        elapsed = time.monotonic() - t0
        problems = []
        msg = str(e)
        if elapsed > group_timeout_s + 10:
            problems.append(f"raised only after {elapsed:.1f}s (timeout {group_timeout_s}s)")
        if not isinstance(e, dist.DistBackendError):
            problems.append(f"raised {type(e).__name__}, not DistBackendError: {msg[:200]}")
        if "time" not in msg.lower():
            problems.append(f"the error does not say it timed out: {msg[:200]}")
        if not re.search(r"all_?reduce", msg, re.I):
            problems.append(f"the error does not name the collective: {msg[:200]}")
        return problems
    return [f"all_reduce with an absent peer returned after {time.monotonic() - t0:.1f}s "
            f"instead of raising"]


def test_timeout_raises_instead_of_hanging(backend):
    results = harness.run_job(backend, 3, _case_timeout, init="file", timeout=60)
    harness.conclude(harness.problems(results),
                     expectations.gap(backend, "timeout", world_size=3),
                     where=f"{backend} timeout")
