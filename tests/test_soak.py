"""A randomized soak and leak checks: a random sequence of collectives, sizes, dtypes, ops and
allreduce algorithms on 4 ranks, every result checked against the one-process reference, with
file descriptors, /dev/shm and resident memory compared between the start and the end.

CI runs it for TORUS_SOAK_SECONDS (default 20) per transport. The long mode is the same test
with a longer budget, e.g. ten minutes on shared memory:

    TORUS_SOAK_SECONDS=600 TORUS_TEST_BACKENDS=torus+shm python -m pytest tests/test_soak.py -q -s

With -s each rank prints its figures (collectives run, wrong results, fds, RSS).
"""

from __future__ import annotations

import gc
import os
import random
import time

import torch
import torch.distributed as dist

import expectations
import harness
from reference import compare, dtype_of, gen, gen_all, redop, reduce_ref, tolerance
from torch_torus.config import ALGORITHMS

SOAK_SECONDS = float(os.environ.get("TORUS_SOAK_SECONDS", "20"))
WORLD_SIZE = 4
DTYPES = ["float32", "float64", "bfloat16", "int32", "int64", "uint8"]
COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce"]


def _resources() -> dict:
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"fds": len(os.listdir("/proc/self/fd")),
            "dev_shm": len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0,
            "rss_mib": rss_pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)}


def _one_step(ctx, step, rng, groups) -> list:
    """One random collective, the same on every rank (the same seed); returns problems."""
    n, rank = ctx.world_size, ctx.rank
    collective = rng.choice(COLLECTIVES)
    dtype = rng.choice(DTYPES)
    count = int(2 ** rng.uniform(0, 20))  # 1 element to 1 Mi elements, log-uniform
    key = ("soak", step)
    label = f"step {step}: {collective} {dtype} x{count}"
    if collective == "all_reduce":
        op = rng.choice(["SUM", "MAX", "MIN"] + (["BXOR"] if not dtype.startswith(("float", "bf")) else []))
        algorithm = rng.choice(sorted(groups))
        inputs = gen_all(key, n, (count,), dtype, op)
        t = inputs[rank].clone()
        dist.all_reduce(t, op=redop(op), group=groups[algorithm])
        ref = reduce_ref(inputs, op)
        return compare(t, ref, tolerance(inputs, op, ref), f"{label} {op} {algorithm}")
    if collective == "broadcast":
        root = rng.randrange(n)
        t = gen(key, rank, (count,), dtype)
        dist.broadcast(t, src=root)
        return compare(t, gen(key, root, (count,), dtype), None, f"{label} root {root}")
    if collective == "all_gather":
        out = torch.empty(n * count, dtype=dtype_of(dtype))
        dist.all_gather_into_tensor(out, gen(key, rank, (count,), dtype))
        return compare(out, torch.cat(gen_all(key, n, (count,), dtype)), None, label)
    if collective == "reduce_scatter":
        inputs = gen_all(key, n, (n * count,), dtype)
        out = torch.empty(count, dtype=dtype_of(dtype))
        dist.reduce_scatter_tensor(out, inputs[rank].clone())
        mine = [x[rank * count:(rank + 1) * count] for x in inputs]
        ref = reduce_ref(mine, "SUM")
        return compare(out, ref, tolerance(mine, "SUM", ref), label)
    if collective == "all_to_all":
        count = max(1, count // n)
        out = torch.empty(n * count, dtype=dtype_of(dtype))
        dist.all_to_all_single(out, gen(key, rank, (n * count,), dtype))
        expected = torch.cat([gen(key, r, (n * count,), dtype)[rank * count:(rank + 1) * count] for r in range(n)])
        return compare(out, expected, None, label)
    root = rng.randrange(n)
    inputs = gen_all(key, n, (count,), dtype)
    t = inputs[rank].clone()
    dist.reduce(t, dst=root)
    if rank != root:
        return []
    ref = reduce_ref(inputs, "SUM")
    return compare(t, ref, tolerance(inputs, "SUM", ref), f"{label} root {root}")


def _case_soak(ctx, seconds, seed):
    import torch_torus

    groups = {a: ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(allreduce=a))
              for a in ALGORITHMS["allreduce"]}
    # Connections are made when an algorithm first needs a peer: an all-to-all on every group
    # (the default one too) links every pair, so connections and segments exist before the
    # first measure and any fd opened later is a leak.
    for group in [None, *groups.values()]:
        dist.all_reduce(torch.ones(1), group=group)
        dist.all_to_all_single(torch.empty(ctx.world_size), torch.ones(ctx.world_size), group=group)
    gc.collect()
    start = _resources()
    rng = random.Random(seed)
    problems, steps = [], 0
    # Every rank must run the same number of steps: rank 0's clock decides, by broadcast.
    began = time.monotonic()
    warm = None  # resources once the first quarter has run: the allocator has its working set
    while True:
        go = torch.tensor([1 if time.monotonic() < began + seconds else 0])
        dist.broadcast(go, src=0)
        if not go.item():
            break
        problems += _one_step(ctx, steps, rng, groups)
        steps += 1
        if warm is None and time.monotonic() > began + seconds / 4:
            gc.collect()
            warm = _resources()
        if len(problems) > 20:
            break
    gc.collect()
    end = _resources()
    warm = warm or end
    for group in groups.values():
        dist.destroy_process_group(group)
    print(f"[soak rank {ctx.rank}] {steps} collectives, {len(problems)} wrong, fds {start['fds']}->{end['fds']}, "
          f"/dev/shm entries {start['dev_shm']}->{end['dev_shm']}, RSS {start['rss_mib']:.1f} MiB at the start, "
          f"{warm['rss_mib']:.1f} after the first quarter, {end['rss_mib']:.1f} at the end",
          flush=True)
    if end["fds"] > start["fds"]:
        problems.append(f"file descriptors grew from {start['fds']} to {end['fds']} over {steps} collectives")
    if end["dev_shm"] > start["dev_shm"]:
        problems.append(f"/dev/shm gained {end['dev_shm'] - start['dev_shm']} entries")
    if steps < 10:
        problems.append(f"only {steps} collectives ran in {seconds}s")
    return problems


def test_randomized_soak(backend):
    expectations.skip_if_not_applicable(backend, "torus.soak")
    harness.check(backend, WORLD_SIZE, _case_soak, SOAK_SECONDS, 20261122, timeout=SOAK_SECONDS + 120)


def _case_create_destroy(ctx, cycles):
    """Groups created, used and destroyed over and over: threads, sockets, fds and segments
    must all go with them."""
    gc.collect()
    first = None
    threads_before = len(os.listdir("/proc/self/task"))
    for cycle in range(cycles):
        group = ctx.new_group(list(range(ctx.world_size)))
        t = torch.full((1000,), float(ctx.rank + 1))
        dist.all_reduce(t, group=group)
        dist.destroy_process_group(group)
        gc.collect()
        if cycle == 0:
            first = _resources()
    last = _resources()
    threads_after = len(os.listdir("/proc/self/task"))
    problems = []
    if last["fds"] > first["fds"]:
        problems.append(f"fds grew from {first['fds']} to {last['fds']} over {cycles} create/destroy cycles")
    if last["dev_shm"] > first["dev_shm"]:
        problems.append(f"/dev/shm grew from {first['dev_shm']} to {last['dev_shm']} entries")
    if threads_after > threads_before:
        problems.append(f"threads grew from {threads_before} to {threads_after}")
    return problems


def test_create_use_destroy_leaks_nothing(backend):
    harness.check(backend, 4, _case_create_destroy, 30, timeout=240)
