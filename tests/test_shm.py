"""The shared-memory transport's own promises: nothing left in /dev/shm, the transport chosen
from where ranks live, the shm-only allreduces refusing what they cannot do, and mismatched calls
named on both sides (a killed peer, in each shm allreduce too: test_faults.py).

(Every collective also runs over shm and tcp alike: conftest's backend parameter.)"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import harness
from reference import first_line

SHM = "torus+shm"


def _shm_entries() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _case_nothing_in_dev_shm(ctx):
    before = _shm_entries()
    group = ctx.new_group(list(range(ctx.world_size)))
    t = torch.ones(1000)
    dist.all_reduce(t, group=group)
    during = _shm_entries()
    dist.destroy_process_group(group)
    problems = [] if t.eq(ctx.world_size).all() else [f"wrong sum {t[:4].tolist()}"]
    if during - before:
        problems.append(f"/dev/shm gained {sorted(during - before)} while a shm group was alive")
    return problems


def test_segments_have_no_name_in_dev_shm():
    harness.check(SHM, 4, _case_nothing_in_dev_shm)


def _case_transport_is_shm_on_one_host(ctx):
    import torch_torus

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    # 64 KiB fits a one-shot slot on shm; over tcp one_shot is not available and falls back.
    got = torch_torus.algorithm_for("allreduce", 1 << 16, dist.group.WORLD)
    return [] if (got == "one_shot") == (ctx.env.get("TORUS_TRANSPORT") != "tcp") else [
        f"TORUS_TRANSPORT={ctx.env.get('TORUS_TRANSPORT')!r}: one_shot chosen as {got!r} ({backend})"]


@pytest.mark.parametrize("transport", ["auto", "shm", "tcp"])
def test_transport_setting_decides_shared_memory_algorithms(transport):
    harness.check("torus", 2, _case_transport_is_shm_on_one_host,
                  env={"TORUS_TRANSPORT": transport, "TORUS_ALLREDUCE": "one_shot"})


def _case_shm_across_hosts_rejected(ctx):
    import torch_torus

    try:
        ctx.new_group(list(range(ctx.world_size)),
                      pg_options=torch_torus.Options(transport="shm", host_id=f"host{ctx.rank}"))
    except Exception as e:
        text = str(e)
        return [] if "TORUS_TRANSPORT" in text and "hosts" in text else [f"unclear error: {first_line(e)}"]
    return ["TORUS_TRANSPORT=shm across two hosts was accepted"]


def test_shm_across_hosts_is_a_config_error():
    harness.check("torus", 2, _case_shm_across_hosts_rejected)


def _case_one_shot_too_large_falls_back(ctx):
    import torch_torus

    group = ctx.new_group(list(range(ctx.world_size)), pg_options=torch_torus.Options(allreduce="one_shot"))
    problems = []
    for nbytes, expected in ((512 * 1024, "one_shot"), (512 * 1024 + 4, "two_shot")):
        got = torch_torus.algorithm_for("allreduce", nbytes, group)
        if got != expected:
            problems.append(f"{nbytes} bytes: {got}, expected {expected}")
    t = torch.full((300_000,), float(ctx.rank + 1))
    dist.all_reduce(t, group=group)
    expected_sum = ctx.world_size * (ctx.world_size + 1) / 2
    if not t.eq(expected_sum).all():
        problems.append(f"fallback allreduce wrong: {t[:4].tolist()}")
    dist.destroy_process_group(group)
    return problems


def test_one_shot_above_its_slot_runs_two_shot():
    harness.check(SHM, 3, _case_one_shot_too_large_falls_back)


def _case_mismatch_named(ctx, algorithm):
    import torch_torus

    group = ctx.new_group(list(range(ctx.world_size)),
                          pg_options=torch_torus.Options(allreduce=algorithm))
    t = torch.ones(1000 + ctx.rank)
    try:
        dist.all_reduce(t, group=group)
    except Exception as e:
        text = str(e)
        want = ["rank 0", "rank 1", "4000 bytes", "4004 bytes"]
        missing = [w for w in want if w not in text]
        if missing or not isinstance(e, dist.DistBackendError):
            return [f"{type(e).__name__} lacks {missing}: {first_line(e)}"]
        return []
    return [f"mismatched sizes were not detected: {t[:4].tolist()}"]


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_mismatched_sizes_name_both_sides(algorithm):
    results = harness.run_job(SHM, 2, _case_mismatch_named, algorithm, init="file")
    harness.conclude(harness.problems(results), None, f"{SHM} mismatch")
