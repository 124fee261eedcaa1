"""The hybrid update (torch_torus.hybrid): host groups from the backend's host identity, the
averager's schedule (period, delay, warm-up, drain) against a one-process simulation of the same
update, ranks of a host bit-identical, a cross-host average that times out reaching step()
naming the rank, a host whose ranks diverged named, bad arguments refused.

Hosts are faked with TORUS_HOST_ID, set per rank before init_process_group in fresh processes
(harness.run_job), so the default group's own host identities are what host_groups() reads."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import harness
from torch_torus.hybrid import plan_host_groups

STEPS = 7
BATCH = 3
LR = 0.05
# (period, delay, warmup_steps): asynchronous, synchronous periodic, delay = period with a
# warm-up, and a drain that finds an average in flight (delay 2 started at step 6 of 7).
SCHEDULES = [(2, 1, 0), (3, 0, 0), (2, 2, 1), (3, 2, 0)]


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 2 * 2, 5)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x)))
        return self.fc(nn.functional.adaptive_avg_pool2d(x, (2, 2)).flatten(1))


def _model(seed):
    torch.manual_seed(seed)
    return SmallNet()


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 3, 6, 6, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _state(model):
    """Parameters and floating buffers, flat: what the averager averages."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _parameter_count(model):
    return sum(p.numel() for p in model.parameters())


def _write_state(model, flat):
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _reference(layout, period, delay, warmup_steps):
    """One process, one model per host, the update written out plainly: each host's gradient is
    the mean over its ranks' batches; its BatchNorm statistics follow its first rank's batches
    (DDP broadcasts the first rank's buffers at every forward); averages as the docstring of
    HybridAverager says. Returns each host's state after STEPS steps, and the state after drain."""
    host_ranks, _ = plan_host_groups(layout)
    models = [_model(0) for _ in host_ranks]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    pending = None  # (apply_at, snapshots, average)

    def average_now():
        mean = sum(_state(m) for m in models) / len(models)
        for m in models:
            _write_state(m, mean)

    def apply(snapshots, mean):
        for m, snapshot in zip(models, snapshots):
            _write_state(m, _state(m) + (mean - snapshot))

    for step in range(1, STEPS + 1):
        for model, optimizer, ranks in zip(models, optimizers, host_ranks):
            optimizer.zero_grad()
            buffers = list(model.buffers())
            for i, rank in enumerate(ranks):
                kept = [b.clone() for b in buffers]
                x, y = _batch(rank, step)
                (nn.functional.cross_entropy(model(x), y) / len(ranks)).backward()
                if i > 0:  # only the host's first rank's statistics survive DDP's next broadcast
                    for b, k in zip(buffers, kept):
                        b.copy_(k)
            optimizer.step()
        if step <= warmup_steps:
            average_now()
            continue
        if pending is not None and pending[0] == step:
            apply(*pending[1:])
            pending = None
        if (step - warmup_steps) % period == 0:
            if delay == 0:
                average_now()
            else:
                snapshots = [_state(m) for m in models]
                pending = (step + delay, snapshots, sum(snapshots) / len(snapshots))
    before_drain = [_state(m) for m in models]
    if pending is not None:
        apply(*pending[1:])
    average_now()
    return before_drain, _state(models[0])


def _gather(flat, group, size):
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat, group=group)
    return everyone


def _case_train(ctx, layout, schedules):
    import torch_torus
    from torch.nn.parallel import DistributedDataParallel

    os.environ["TORUS_HOST_ID"] = f"host-{layout[ctx.rank]}"
    ctx.init_process_group(init="file")
    problems = []
    groups = torch_torus.host_groups()
    expected_host, expected_cross = plan_host_groups(layout)
    host_index = next(h for h, ranks in enumerate(expected_host) if ctx.rank in ranks)
    expected = (expected_host[host_index], expected_cross[expected_host[host_index].index(ctx.rank)])
    if (groups.host_ranks, groups.cross_ranks, groups.num_hosts) != (*expected, len(expected_host)):
        problems.append(f"groups {groups.host_ranks}, {groups.cross_ranks}, {groups.num_hosts} hosts; "
                        f"expected {expected}, {len(expected_host)} hosts")
    with pytest.raises(ValueError, match=r"process_group=groups.host"):
        torch_torus.HybridAverager(DistributedDataParallel(_model(0)), groups, period=2)

    for period, delay, warmup_steps in schedules:
        label = f"period {period} delay {delay} warmup {warmup_steps}"
        # Every rank starts from its own weights: the averager must give them rank 0's.
        model = DistributedDataParallel(_model(ctx.rank), process_group=groups.host)
        averager = torch_torus.HybridAverager(model, groups, period, delay, warmup_steps)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        for group in (None, groups.host, groups.cross):
            torch_torus.reset_traffic(group)
        for step in range(1, STEPS + 1):
            optimizer.zero_grad()
            x, y = _batch(ctx.rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            averager.step()
        sent = {name: torch_torus.traffic(group)["other_host_bytes"]
                for name, group in (("world", None), ("host", groups.host), ("cross", groups.cross))}
        if sent["world"] or sent["host"] or not sent["cross"]:
            problems.append(f"{label}: bytes sent to other hosts by group: {sent}; only the "
                            f"cross-host group should send any")
        mine = _state(model.module)
        averager.drain()
        drained = _state(model.module)
        before_drain, after_drain = _reference(layout, period, delay, warmup_steps)
        # Between averages a host's ranks share their parameters, and hold BatchNorm statistics
        # of their own batches, of which the first rank's are the host's.
        compared = mine.numel() if ctx.rank == groups.host_ranks[0] else _parameter_count(model.module)
        for what, got, want in (("after training", mine[:compared], before_drain[host_index][:compared]),
                                ("after drain", drained, after_drain)):
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                problems.append(f"{label}: {what} differs from the one-process reference by up to "
                                f"{(got - want).abs().max().item():.3g}")
        parameters = mine[:_parameter_count(model.module)]
        host_parameters = _gather(parameters, groups.host, len(groups.host_ranks))
        if not all(torch.equal(other, parameters) for other in host_parameters):
            problems.append(f"{label}: the parameters of host {groups.host_ranks}'s ranks differ after training")
        if not all(torch.equal(other, drained) for other in _gather(drained, None, ctx.world_size)):
            problems.append(f"{label}: the ranks differ after drain")
    return problems


@pytest.mark.parametrize("layout", ["abab", "aabb"], ids=["interleaved_hosts", "contiguous_hosts"])
def test_hybrid_matches_reference(layout):
    """4 ranks on 2 faked hosts, numbered across hosts (as srun's cyclic distribution does) or by host."""
    harness.conclude(harness.problems(harness.run_job("torus", 4, _case_train, list(layout), SCHEDULES,
                                                      timeout=120)), None, f"hybrid {layout}")


def _case_cross_host_timeout(ctx):
    import torch_torus

    os.environ["TORUS_HOST_ID"] = f"host-{'aabb'[ctx.rank]}"
    ctx.init_process_group(init="file")
    groups = torch_torus.host_groups(timeout=datetime.timedelta(seconds=2))
    averager = torch_torus.HybridAverager(_model(0), groups, period=1, delay=1)
    if ctx.rank >= 2:
        return []  # host b stops taking part: host a's average never completes
    averager.step()  # starts the average of step 1, applied at step 2
    try:
        averager.step()
    except torch_torus.HybridUpdateError as error:
        message = str(error)
        wanted = [f"rank {ctx.rank}'s cross-host average", str(groups.cross_ranks), "at step 1",
                  "at step 2"]
        missing = [w for w in wanted if w not in message]
        return [f"the error does not say {missing}: {message}"] if missing else []
    return ["step() returned although the other host never took part in the average"]


def test_cross_host_failure_reaches_step():
    harness.conclude(harness.problems(harness.run_job("torus", 4, _case_cross_host_timeout, timeout=60)),
                     None, "hybrid timeout")


def _case_diverged_host_and_bad_arguments(ctx):
    import torch_torus

    problems = []
    groups = torch_torus.host_groups()
    model = _model(0)
    for arguments, name in [(dict(period=0), "period"), (dict(period=2, delay=3), "delay"),
                            (dict(period=2, delay=-1), "delay"), (dict(period=2, warmup_steps=-1), "warmup_steps"),
                            (dict(period=1.5), "period")]:
        try:
            torch_torus.HybridAverager(model, groups, **arguments)
            problems.append(f"{arguments} accepted")
        except ValueError as error:
            if name not in str(error) or repr(list(arguments.values())[-1]) not in str(error):
                problems.append(f"{arguments}: the error does not name {name} and its value: {error}")
    averager = torch_torus.HybridAverager(model, groups, period=1)
    if ctx.rank == 1:
        with torch.no_grad():
            model.fc.bias[0] += 1e-3
    try:
        averager.step()
        problems.append("a host whose ranks diverged went unnoticed")
    except torch_torus.HybridUpdateError as error:
        if "rank(s) [1]" not in str(error) or "than rank 0" not in str(error):
            problems.append(f"the error does not name ranks 1 and 0: {error}")
    return problems


def test_diverged_host_and_bad_arguments(backend):
    harness.check(backend, 2, _case_diverged_host_and_bad_arguments, timeout=60)


class _ComplexModel(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3, 2, dtype=dtype))
        self.register_buffer("phase", torch.zeros(5, dtype=dtype))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def _case_complex_average(ctx):
    """2 ranks on 2 faked hosts: complex parameters and buffers are averaged as complex numbers
    (real and imaginary parts apart); a module mixing precisions is refused by name."""
    import torch_torus

    os.environ["TORUS_HOST_ID"] = f"host-{'ab'[ctx.rank]}"
    ctx.init_process_group(init="file")
    groups = torch_torus.host_groups()
    problems = []
    for dtype in (torch.complex128, torch.complex64):
        model = _ComplexModel(dtype)
        averager = torch_torus.HybridAverager(model, groups, period=1)
        values = {r: torch.complex(torch.full((3, 2), 1.0 + r), torch.full((3, 2), -3.0 * r)).to(dtype)
                  for r in range(2)}
        with torch.no_grad():
            model.weight.copy_(values[ctx.rank])
            model.phase.copy_(values[ctx.rank].reshape(-1)[:5] * 1j)
            model.steps.fill_(7)
        averager.drain()
        mean = (values[0] + values[1]) / 2
        if not torch.allclose(model.weight.detach(), mean):
            problems.append(f"{dtype} weight: got {model.weight.detach().reshape(-1)[:2].tolist()}, "
                            f"want {mean.reshape(-1)[:2].tolist()}")
        if not torch.allclose(model.phase, mean.reshape(-1)[:5] * 1j):
            problems.append(f"{dtype} complex buffer not averaged: {model.phase[:2].tolist()}")
        if model.steps.item() != 7:
            problems.append(f"the integer buffer changed: {model.steps.item()}")
    mixed = _ComplexModel(torch.complex128)
    mixed.extra = torch.nn.Linear(2, 2)  # float32 beside complex128 (float64 parts)
    try:
        torch_torus.HybridAverager(mixed, groups, period=1)
        problems.append("a module mixing complex128 and float32 was accepted")
    except ValueError as error:
        if "torch.complex128" not in str(error) or "torch.float32" not in str(error):
            problems.append(f"the error does not name the dtypes: {error}")
    return problems


def test_complex_parameters_and_buffers_are_averaged():
    harness.conclude(harness.problems(harness.run_job("torus", 2, _case_complex_average, timeout=60)),
                     None, "hybrid complex")


def test_plan_host_groups():
    # srun's cyclic distribution: hosts x, y, x, y, ...
    assert plan_host_groups(list("xyxyxy")) == ([[0, 2, 4], [1, 3, 5]], [[0, 1], [2, 3], [4, 5]])
    assert plan_host_groups(list("aaaa")) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    with pytest.raises(ValueError, match=r"same number of ranks on every host.*'a': ranks \[0, 1\].*'b': ranks \[2\]"):
        plan_host_groups(list("aab"))
