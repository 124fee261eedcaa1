"""Settings every rank must share are compared when a group is created (issue 44).

One rank holds another value of each shared setting in turn (config.SETTINGS marked shared; a new
one must be given a value here): every rank fails creation with a ConfigError naming the setting,
both values and the ranks holding each, and none returns a result. So does a tuning file that
gives one rank another allreduce table, and the issue's six ranks with one rank's grid 3x2.
Settings that may differ (log level, ...) leave the group working. Each job runs in fresh
processes; its attempts each rendezvous at a store of their own, since a refused creation
leaves nothing behind (a process per attempt would cost 2 s of CPU each for torch's import)."""

from __future__ import annotations

import datetime

import pytest

import harness
from torch_torus import tuning
from torch_torus.config import SETTINGS

# Per shared setting: (the value of every rank but rank 1, rank 1's value), as torch_torus.Options
# takes them, and as the error shows them.
DIFFERENT = {
    "TORUS_ALLREDUCE": ("ring", "direct"),
    "TORUS_ALLGATHER": ("ring", "direct"),
    "TORUS_REDUCE_SCATTER": ("ring", "direct"),
    "TORUS_BROADCAST": ("binomial", "chain"),
    "TORUS_BARRIER": ("dissemination", "shared_memory"),
    "TORUS_TORUS_DIMS": ("1x2", "2x1"),
    "TORUS_TORUS_INNER": ("ring", "direct"),
    "TORUS_TRANSPORT": ("tcp", "shm"),
    "TORUS_OFI_PROVIDER": ("", "tcp"),
    "TORUS_OFI_RMA_BYTES": ("auto", "1M"),
    "TORUS_CHUNK_BYTES": ("512K", "64K"),
    "TORUS_EAGER_BYTES": ("512K", "0"),
    "TORUS_EAGER_WINDOW": ("4M", "1M"),
    "TORUS_LINK_BANDWIDTH": ("10gbit", "1gbit"),
    "TORUS_LINK_LATENCY": ("20us", "2ms"),
    "TORUS_HOST_DEVICE": ("off", "on"),
}
# Settings that may differ, and a value for rank 1 (the others keep the default).
MAY_DIFFER = {
    "TORUS_HOST_ID": None,  # changes the group's hosts: tests/test_traffic.py and test_hybrid.py
    "TORUS_INLINE_BYTES": "0",
    "TORUS_WAIT": "pause",
    "TORUS_SOCKET_IFNAME": "lo",
    "TORUS_TUNING_FILE": None,  # its table is compared: test_a_tuned_table_that_differs_...
    "TORUS_DEVICE_STALL_TIMEOUT": "5s",
    "TORUS_LOG_LEVEL": "debug",
    "TORUS_TRACE_BUFFER": "0",
    "TORUS_SHARED_TENSOR_CACHE": "1M",
    "TORUS_TRACE_DIR": None,  # the session's directory (conftest); a second one would be left behind
}
BY_NAME = {s.name: s for s in SETTINGS}
TIMEOUT = datetime.timedelta(seconds=60)


def test_every_setting_is_covered():
    assert set(DIFFERENT) == {s.name for s in SETTINGS if s.shared}
    assert set(MAY_DIFFER) == {s.name for s in SETTINGS if not s.shared}


def _attempt(ctx, tag: str, options: dict) -> dict:
    """init_process_group with `options` on this rank (at a store of its own); what happened."""
    import torch
    import torch.distributed as dist
    import torch_torus

    try:
        ctx.init_process_group(init="file", tag=f"-{tag}", timeout=TIMEOUT, pg_options=torch_torus.Options(**options))
    except Exception as error:  # noqa: BLE001 - the type is checked by the test
        return {"raised": type(error).__name__, "message": str(error)}
    t = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"raised": None, "result": t.tolist()}


def _case_attempts(ctx, attempts: dict) -> dict:
    """attempts: tag -> (options of every rank, rank 1's own)."""
    return {tag: _attempt(ctx, tag, {**common, **(mine if ctx.rank == 1 else {})})
            for tag, (common, mine) in attempts.items()}


@pytest.fixture(scope="module")
def differing():
    attempts = {}
    for name, (value, other) in DIFFERENT.items():
        option = BY_NAME[name].option
        common = {"transport": "tcp", option: value}
        attempts[name] = (common, {option: other})
    return harness.run_job("torus", 2, _case_attempts, attempts, timeout=240)


@pytest.mark.parametrize("name", list(DIFFERENT))
def test_a_shared_setting_that_differs_fails_creation_on_every_rank_naming_it(differing, name):
    value, other = DIFFERENT[name]
    setting = BY_NAME[name]
    shown = [setting.render(setting.parse(v)) for v in (value, other)]
    if setting.agreed:
        shown = [str(setting.agreed(setting.parse(v))) for v in (value, other)]
    for rank in range(2):
        r = differing[rank][name]
        assert r["raised"] == "ConfigError", f"rank {rank}: {r}"
        assert (f"{name} differs between ranks: {shown[0]!r} on rank 0, {shown[1]!r} on rank 1"
                in r["message"]), f"rank {rank}: {r['message']}"


def test_settings_that_may_differ_leave_the_group_working():
    given = {BY_NAME[name].option: value for name, value in MAY_DIFFER.items() if value is not None}
    results = harness.run_job("torus", 2, _case_attempts, {"may_differ": ({"transport": "tcp"}, given)},
                              timeout=120)
    for rank in range(2):
        r = results[rank]["may_differ"]
        assert r["raised"] is None and r["result"] == [3.0, 3.0, 3.0], f"rank {rank}: {r}"


def test_a_tuned_table_that_differs_fails_creation_naming_it(tmp_path):
    """The ranks read tuning files of their own (the path may differ), whose tables do not agree."""
    layout = tuning.Layout(2, None, (2,), "tcp")
    sizes = [0, 1 << 20]
    paths = []
    for winner in ("ring", "direct"):
        path = str(tmp_path / f"{winner}.json")
        times = {algorithm: [1.0 if algorithm == winner else 2.0] * 2 for algorithm in ("ring", "direct")}
        tuning.write(path, tuning.make_entry(layout, sizes, times, {}))
        paths.append(path)
    attempts = {"tuned": ({"transport": "tcp", "tuning_file": paths[0]}, {"tuning_file": paths[1]})}
    results = harness.run_job("torus", 2, _case_attempts, attempts, timeout=120)
    for rank in range(2):
        r = results[rank]["tuned"]
        assert r["raised"] == "ConfigError", f"rank {rank}: {r}"
        assert "the allreduce table differs between ranks" in r["message"], r["message"]
        assert "'ring:0-max' on rank 0, 'direct:0-max' on rank 1" in r["message"], r["message"]


def _case_grid(ctx):
    import os

    os.environ["TORUS_TORUS_DIMS"] = "3x2" if ctx.rank == 5 else "2x3"
    return _attempt(ctx, "grid", {"allreduce": "torus"})


def test_six_ranks_one_with_another_grid_fail_creation_naming_it():
    """Issue 44's case: rank 5 alone with TORUS_TORUS_DIMS=3x2 computed a wrong result silently."""
    results = harness.run_job("torus+tcp", 6, _case_grid, timeout=120)
    for rank, r in enumerate(results):
        assert r["raised"] == "ConfigError", f"rank {rank}: {r}"
        assert "TORUS_TORUS_DIMS differs between ranks: '2x3' on ranks 0-4, '3x2' on rank 5" in r["message"], \
            f"rank {rank}: {r['message']}"
