"""Collectives issued from callbacks: a future's then(), a Work's future, DDP comm hooks.

Every form (the future's wait, a sync call, Work.wait, torch.ops.torus, other collectives, two
levels of callbacks) runs and gives the reference's values, on 1 to 8 ranks. Collectives a
callback issues take their place where its then() was, before what the main thread issues after
it, on every rank (tests/test_callback_order.py has the rest); a callback that waits for a collective issued after it ends at the group's timeout
with an error naming the job whose callbacks the queue waited behind. DDP trains with every
built-in comm hook that gloo accepts on CPU to the same parameters as gloo (PowerSGD with many
buckets against gloo running the hook one bucket at a time, since gloo itself hangs there)."""

from __future__ import annotations

import datetime
import re
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import harness
from test_ddp import LR, _batch, _diff, _model

FORMS = ["future_wait", "sync", "work_wait", "op", "other_collectives", "two_levels", "interleaved"]
TORUS_ONLY_FORMS = {
    "op": "torch.ops.torus is torus's",
    "interleaved": "the order of a callback's collectives against the main thread's is torus's (gloo runs "
                   "callbacks whenever a worker completes a job)",
    "two_levels": "gloo hangs when a callback waits for a collective whose callback waits for another "
                  "(seen at 1 rank: its workers are all in callbacks)",
}


def _nested(form, t, world_size):
    """What a callback does with the output t of the first all_reduce: reduce it again, one way
    or another; returns the tensor it reduced into."""
    if form == "future_wait":
        return dist.all_reduce(t, async_op=True).get_future().wait()[0]
    if form in ("sync", "interleaved"):
        dist.all_reduce(t)
        return t
    if form == "work_wait":
        dist.all_reduce(t, async_op=True).wait()
        return t
    if form == "op":
        torch.ops.torus.all_reduce_(t, dist.group.WORLD.group_name, "sum")
        return t
    if form == "other_collectives":
        dist.broadcast(t, src=world_size - 1)
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t)
        if dist.get_backend() != "gloo":  # gloo's barrier waits for every earlier work: this one's too
            dist.barrier()
        return torch.stack(parts).sum(0)
    if form == "two_levels":
        doubled = dist.all_reduce(t, async_op=True).get_future().then(
            lambda f: dist.all_reduce(f.value()[0] / world_size, async_op=True).get_future().wait()[0])
        return doubled.wait()
    raise ValueError(form)


def collective_from_callback(ctx, form, device):
    """The case on tensors of `device` (test_cuda runs it on the GPU)."""
    n = ctx.world_size
    problems = []
    first = n * (n + 1) / 2  # the first all_reduce of rank + 1
    want = first * n  # reduced once more, whichever way
    for numel in (5, 100_000):
        t = torch.full((numel,), ctx.rank + 1.0, device=device)
        future = dist.all_reduce(t, async_op=True).get_future().then(lambda f: _nested(form, f.value()[0], n))
        others = []
        if form == "interleaved":
            # Issued by this thread while the callbacks may run: the same order on every rank.
            others = [(torch.full((numel,), ctx.rank * 10.0 + i, device=device), i) for i in range(3)]
            others = [(u, i, dist.all_reduce(u, async_op=True)) for u, i in others]
        got = future.wait().cpu()
        if not torch.equal(got, torch.full((numel,), want)):
            problems.append(f"{form}, {numel} floats: got {got[:3].tolist()}..., want {want}")
        for u, i, work in others:
            work.wait()
            expected = 10.0 * n * (n - 1) / 2 + i * n
            if not torch.equal(u.cpu(), torch.full((numel,), expected)):
                problems.append(f"{form}: the main thread's all_reduce #{i}: got {u[:3].tolist()}, want {expected}")
    return problems


def _case_collective_from_callback(ctx, form):
    return collective_from_callback(ctx, form, "cpu")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8], ids=lambda w: f"ws{w}")
def test_collective_from_callback(backend, world_size, form):
    if not backend.startswith("torus") and form in TORUS_ONLY_FORMS:
        pytest.skip(TORUS_ONLY_FORMS[form])
    harness.check(backend, world_size, _case_collective_from_callback, form, timeout=120)


def _case_callback_waits_for_later_collective(ctx):
    """The callback of A waits for B, issued after it: B is queued behind A's callbacks and never
    starts. B's wait must end at the group's timeout, naming A; the callback then fails, and
    the group with it."""
    ctx.init_process_group(init="file")
    problems = []
    group = dist.new_group(backend="torus", timeout=datetime.timedelta(seconds=3))
    issued = threading.Event()
    later = {}

    def wait_for_later(future):
        issued.wait(30)
        later["work"].wait()

    first = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    chained = first.get_future().then(wait_for_later)
    later["work"] = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    issued.set()
    first.wait()  # A's result is there although its callback has not returned
    try:
        later["work"].wait()
        problems.append("the all_reduce queued behind a callback that waits for it returned")
    except dist.DistBackendError as error:
        text = str(error)
        wanted = ["did not start: queued behind torus:all_reduce", "whose future's callbacks have not returned",
                  "(the timeout of 3000 ms expired)", f"rank {ctx.rank} of {ctx.world_size}"]
        missing = [w for w in wanted if w not in text]
        # B never started (no number of its own); A, the call before it, did.
        if missing or not re.match(r"torus:all_reduce\S* \(queued\) .*queued behind torus:all_reduce\S* #\d+ ", text):
            problems.append(f"the error does not say {missing} or name the call it waited behind: {text}")
    try:
        chained.wait()
        problems.append("the callback that waited for the stalled all_reduce succeeded")
    except RuntimeError:
        pass
    try:
        dist.all_reduce(torch.ones(4), group=group)
        problems.append("the group was still usable after the stall")
    except dist.DistBackendError as error:
        if "earlier failure" not in str(error):
            problems.append(f"a later call's error does not name the stall: {error}")
    return problems


def test_callback_waiting_for_a_later_collective_ends_at_the_timeout():
    harness.conclude(harness.problems(
        harness.run_job("torus", 2, _case_callback_waits_for_later_collective, timeout=60)), None, "stall")


# --- DDP comm hooks -------------------------------------------------------------------------

STEPS = 6
# Hooks that issue collectives from their futures' callbacks (gloo cannot run them with many
# buckets: its hooks' collectives pair differently across ranks and it hangs).
CALLBACK_HOOKS = {"powerSGD", "powerSGD_rank2", "fp16_powerSGD", "registry_powerSGD"}
HOOKS = ["powerSGD", "powerSGD_rank2", "fp16_powerSGD", "noop", "post_localSGD", "fused_sgd",
         "registry_allreduce", "registry_fp16", "registry_powerSGD"]


def _one_bucket_at_a_time(hook):
    """The hook, waited for before DDP goes on: gloo's way to run a callback hook with many buckets."""
    def run(state, bucket):
        value = hook(state, bucket).wait()
        done = torch.futures.Future()
        done.set_result(value)
        return done
    return run


def train_with_hook(ctx, group, hook, bucket_cap_mb, one_at_a_time, subgroup_backend, device="cpu"):
    """test_ddp's net trained STEPS steps over `group` (None: the default) with `hook`; its
    parameters, on the CPU."""
    from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = group or dist.group.WORLD
    device = torch.device(device)
    ddp = DDP(_model().to(device), process_group=group, bucket_cap_mb=bucket_cap_mb,
              device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    averager = None
    wrap = _one_bucket_at_a_time if one_at_a_time else (lambda h: h)
    if hook.startswith("powerSGD") or hook == "fp16_powerSGD":
        state = powerSGD_hook.PowerSGDState(process_group=group, start_powerSGD_iter=2,
                                            matrix_approximation_rank=2 if hook.endswith("rank2") else 1)
        chosen = powerSGD_hook.powerSGD_hook
        ddp.register_comm_hook(state, wrap(default_hooks.fp16_compress_wrapper(chosen) if hook == "fp16_powerSGD"
                                           else chosen))
    elif hook == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif hook == "post_localSGD":
        subgroup, _ = dist.new_subgroups(group_size=max(1, ctx.world_size // 2), backend=subgroup_backend)
        state = post_localSGD_hook.PostLocalSGDState(process_group=group, subgroup=subgroup, start_localSGD_iter=2)
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        averager = PeriodicModelAverager(period=2, warmup_steps=2, process_group=group)
    elif hook == "fused_sgd":
        ddp._register_fused_optim(torch.optim.SGD, lr=LR, momentum=0.9)
        opt = None
    elif hook.startswith("registry_"):
        kind = {"registry_allreduce": DDPCommHookType.ALLREDUCE, "registry_fp16": DDPCommHookType.FP16_COMPRESS,
                "registry_powerSGD": DDPCommHookType.POWER_SGD}[hook]
        kind.value(model=ddp, state=group)
    else:
        raise ValueError(hook)
    for step in range(STEPS):
        if opt is not None:
            opt.zero_grad()
        x, y = _batch(ctx.rank, step)
        nn.functional.cross_entropy(ddp(x.to(device, copy=True)), y.to(device, copy=True)).backward()
        if opt is not None:
            opt.step()
        if averager is not None:
            averager.average_parameters(ddp.parameters())
    return [p.detach().cpu() for p in ddp.module.parameters()]


def compare_replicas(ctx, parameters, gloo):
    """Problems when the ranks' parameters are not bitwise alike (compared over a gloo group)."""
    flat = torch.cat([p.reshape(-1) for p in parameters])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat, group=gloo)
    return [f"replica on rank {r} differs from rank 0" for r in range(ctx.world_size)
            if not torch.equal(gathered[r], gathered[0])]


def _case_ddp_hook(ctx, hook, bucket_cap_mb):
    if "gloo_group" not in ctx.state:
        ctx.state["gloo_group"] = dist.new_group(backend="gloo")
    gloo = ctx.state["gloo_group"]
    callbacks_with_many_buckets = hook in CALLBACK_HOOKS and bucket_cap_mb < 1
    mine = train_with_hook(ctx, None, hook, bucket_cap_mb, callbacks_with_many_buckets and ctx.backend == "gloo",
                           None)
    theirs = train_with_hook(ctx, gloo, hook, bucket_cap_mb, callbacks_with_many_buckets, "gloo")
    tight = (1e-3, 1e-4) if "fp16" in hook else (1e-5, 1e-6)
    problems = _diff(mine, theirs, *tight, f"{ctx.backend} vs gloo ({hook})")
    # Without communication (noop), or after a step of local SGD, ranks differ.
    if hook not in ("noop", "post_localSGD"):
        problems += compare_replicas(ctx, mine, gloo)
    return problems


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.001], ids=["one_bucket", "many_buckets"])
@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda w: f"ws{w}")
def test_ddp_comm_hook_matches_gloo(backend, world_size, hook, bucket_cap_mb):
    if bucket_cap_mb < 1 and hook not in CALLBACK_HOOKS | {"post_localSGD"}:
        pytest.skip("many buckets matter for hooks whose callbacks communicate")
    harness.check(backend, world_size, _case_ddp_hook, hook, bucket_cap_mb, timeout=120)


def _case_bf16_refused_as_by_gloo(ctx):
    """torch's bf16 hook refuses CPU groups (it wants NCCL or XCCL): the same error over torus
    as over gloo."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    if "gloo_group" not in ctx.state:
        ctx.state["gloo_group"] = dist.new_group(backend="gloo")
    errors = []
    for group in (dist.group.WORLD, ctx.state["gloo_group"]):
        ddp = DDP(_model(), process_group=group)
        x, y = _batch(ctx.rank, 0)
        try:
            ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
            nn.functional.cross_entropy(ddp(x), y).backward()
            errors.append(None)
        except Exception as error:  # noqa: BLE001 - compared below
            errors.append((type(error).__name__, str(error).splitlines()[0]))
    return [] if errors[0] == errors[1] else [f"{ctx.backend}: {errors[0]}; gloo: {errors[1]}"]


def test_bf16_hook_behaves_as_over_gloo(backend):
    harness.check(backend, 2, _case_bf16_refused_as_by_gloo, timeout=60)
