"""DistributedDataParallel on a small conv net: the backend under test must train to the same
parameters as gloo (same job: the default group is the backend under test, plus a gloo
new_group) and as a one-process reference (the mean loss over every rank's batch); with
and without comm hooks, including a hook built on the work's future."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import harness

STEPS = 4
BATCH = 3
LR = 0.05


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2)
        self.fc1 = nn.Linear(8 * 4, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = nn.functional.adaptive_avg_pool2d(x, (2, 2)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def _model(seed=0):
    torch.manual_seed(seed)
    return SmallNet()


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 3, 10, 10, generator=g)
    y = torch.randint(0, 5, (BATCH,), generator=g)
    return x, y


def _reference(world_size):
    """One process: gradient of the mean over ranks of each rank's mean loss (what DDP's
    gradient averaging computes)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(nn.functional.cross_entropy(model(x), y)
                   for x, y in (_batch(r, step) for r in range(world_size))) / world_size
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _future_hook(group, bucket):
    """A user comm hook on the future of an async all_reduce (mean of the bucket)."""
    t = bucket.buffer()
    t.div_(dist.get_world_size(group))
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _register(ddp, hook, group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook == "none":
        return
    if hook == "future_hook":
        ddp.register_comm_hook(group, _future_hook)
    elif hook == "allreduce_hook":
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    elif hook == "fp16_compress":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    else:
        raise ValueError(hook)


def _train(ctx, group, hook, bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model(), process_group=group, bucket_cap_mb=bucket_cap_mb)
    _register(ddp, hook, group if group is not None else dist.group.WORLD)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(ctx.rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _diff(a, b, rtol, atol, label):
    problems = []
    for i, (p, q) in enumerate(zip(a, b)):
        if not torch.allclose(p, q, rtol=rtol, atol=atol):
            d = (p - q).abs().max().item()
            problems.append(f"{label}: parameter #{i} {tuple(p.shape)} differs, max |diff| {d:.3g}")
    return problems


def _case_ddp(ctx, hook, bucket_cap_mb):
    n = ctx.world_size
    if "gloo_group" not in ctx.state:  # the comparison group, created once per pool
        ctx.state["gloo_group"] = dist.new_group(backend="gloo")
    mine = _train(ctx, None, hook, bucket_cap_mb)  # default group = backend under test
    theirs = _train(ctx, ctx.state["gloo_group"], hook, bucket_cap_mb)
    ref = _reference(n)
    compressed = hook.endswith("compress")
    problems = []
    # against gloo running the same thing: only the summation order may differ
    tight = (1e-3, 1e-4) if compressed else (1e-5, 1e-6)
    problems += _diff(mine, theirs, *tight, f"{ctx.backend} vs gloo ({hook})")
    # against the one-process reference
    loose = (2e-2, 2e-3) if compressed else (1e-4, 1e-5)
    problems += _diff(mine, ref, *loose, f"{ctx.backend} vs one-process reference ({hook})")
    # DDP keeps replicas identical: every rank must hold bitwise the same parameters
    flat = torch.cat([p.reshape(-1) for p in mine])
    gathered = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(gathered, flat, group=ctx.state["gloo_group"])
    for r in range(n):
        if not torch.equal(gathered[r], gathered[0]):
            problems.append(f"replica on rank {r} differs from rank 0 "
                            f"(max |diff| {(gathered[r] - gathered[0]).abs().max().item():.3g})")
    return problems


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.001], ids=["one_bucket", "many_buckets"])
@pytest.mark.parametrize("hook", ["none", "future_hook", "allreduce_hook", "fp16_compress"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8], ids=lambda w: f"ws{w}")
def test_ddp_matches_gloo_and_reference(backend, world_size, hook, bucket_cap_mb):
    harness.check(backend, world_size, _case_ddp, hook, bucket_cap_mb, timeout=120)
