"""When a rank dies: torchrun's restarts, in-process re-creation, and nothing left behind.

A rank SIGKILLed during group creation, inside a collective or between steps, under torchrun
--max-restarts 1 (its c10d rendezvous, --standalone, and the static one): the next attempt
creates its group although the agent's store still holds the first attempt's keys, trains to the
end, and the replicas are equal. In one process: the survivors of a rank's exit destroy the group
and create one of their own; destroying and creating groups again and again leaves no fd, thread
or mapping behind, and killed jobs leave nothing in /dev/shm. The jobs are tests/recovery_jobs.py;
every run is bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import harness
from test_cluster import cluster_available, run_cluster  # noqa: F401  (a fixture and its runner)

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, "recovery_jobs.py")
BOUND_S = 150


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _torchrun(tmp_path, args, mode, env, ranks):
    out = tmp_path / "events.jsonl"
    environ = {**os.environ, **env, "OUT": str(out), "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "torch.distributed.run", *args, "--nproc-per-node", str(ranks), JOBS, mode]
    try:
        done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun did not finish within {BOUND_S} s: {' '.join(command)}\n{error.stdout}\n{error.stderr}")
    events = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return done, events


def _report_restart(events, label):
    """Prints the time from the first kill to the second attempt's first step (for BENCHMARKS.md)."""
    kills = [e["at"] for e in events if e["event"] == "kill"]
    restarted = [e["at"] for e in events if e["event"] == "step" and e["attempt"] == 1 and e["step"] == 0]
    if kills and restarted:
        print(f"{label}: from the kill to the second attempt's first step {min(restarted) - kills[0]:.2f} s")


def _standalone(tmp_path):
    return ["--standalone"]


def _static(tmp_path):
    return ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(harness.free_port()),
            "--nnodes", "1", "--node-rank", "0"]


@pytest.mark.parametrize("kill_at", ["creation", "collective", "between_steps"])
@pytest.mark.parametrize("rendezvous", ["standalone", "static"])
def test_torchrun_restart_after_a_kill(tmp_path, rendezvous, kill_at):
    if rendezvous == "static" and kill_at != "between_steps":
        pytest.skip("the static rendezvous once, at one point")
    shm_before = _shm_entries()
    args = (_standalone if rendezvous == "standalone" else _static)(tmp_path)
    done, events = _torchrun(tmp_path, [*args, "--max-restarts", "1"], "restart",
                             {"KILL_AT": kill_at, "KILL_RANK": "2", "KILL_STEP": "5", "STEPS": "10"}, 4)
    finished = [e for e in events if e["event"] == "done"]
    problems = []
    if done.returncode != 0:
        problems.append(f"torchrun exited with {done.returncode}")
    if sorted(e["rank"] for e in finished if e["attempt"] == 1) != [0, 1, 2, 3]:
        problems.append(f"the second attempt did not finish on every rank: {finished}")
    if not all(e["replica_equal"] for e in finished):
        problems.append(f"replicas differ at the end: {finished}")
    left = _shm_entries() - shm_before
    if left:
        problems.append(f"left in /dev/shm: {sorted(left)}")
    _report_restart(events, f"{rendezvous}, kill at {kill_at}")
    if problems:
        pytest.fail("\n".join(problems) + f"\nevents: {events}\nstderr:\n{done.stderr[-6000:]}")


def test_survivors_recreate_their_group_in_process(tmp_path):
    """3 ranks; rank 2 exits after an all_reduce; ranks 0 and 1 get DistBackendError, destroy the
    group and run an all_reduce in a new group of two. Before that, 3 cycles of create, all_reduce
    and destroy leave no fd, thread or mapping of ours behind."""
    done, events = _torchrun(tmp_path, ["--standalone"], "in_process", {"CYCLES": "4"}, 3)
    problems = [] if done.returncode == 0 else [f"torchrun exited with {done.returncode}"]
    recovered = {e["rank"]: e for e in events if e["event"] == "recovered"}
    if sorted(recovered) != [0, 1]:
        problems.append(f"the survivors did not recover: {events}")
    for rank, event in recovered.items():
        if event["value"] != event["expected"]:
            problems.append(f"rank {rank}: the new group's all_reduce gave {event['value']}, not {event['expected']}")
        print(f"rank {rank}: destroy_process_group {event['destroy_ms']:.1f} ms, the new group's first "
              f"all_reduce done {event['recovered_ms']:.1f} ms after the error")
    for event in (e for e in events if e["event"] == "cycles"):
        if event["after"] != event["before"]:
            problems.append(f"rank {event['rank']}: after 3 more create/destroy cycles it holds {event['after']}, "
                            f"after the first {event['before']}")
    errors = [e["error"] for e in events if e["event"] == "error"]
    if any("rank 2" not in error for error in errors):
        problems.append(f"the survivors' errors do not name rank 2: {errors}")
    if problems:
        pytest.fail("\n".join(problems) + f"\nstderr:\n{done.stderr[-6000:]}")


def _case_same_name_same_store(ctx):
    """A group destroyed and created again on the same store under the same name reads none of the
    keys the first one left (before epochs it read their shared-memory fds and meeting)."""
    import torch
    import torch.distributed as dist

    ctx.import_backend()
    problems = []
    store = dist.FileStore(os.path.join(ctx.scratch, "same-store"), ctx.world_size)
    for cycle in range(3):
        dist.init_process_group("torus", store=store, rank=ctx.rank, world_size=ctx.world_size)
        t = torch.full((1000,), float(ctx.rank + cycle))
        dist.all_reduce(t)
        want = sum(r + cycle for r in range(ctx.world_size))
        if t[0].item() != want:
            problems.append(f"cycle {cycle}: {t[0].item()} != {want}")
        dist.destroy_process_group()
    return problems


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_same_group_name_on_the_same_store(transport):
    harness.conclude(harness.problems(harness.run_job("torus", 3, _case_same_name_same_store,
                                                      env={"TORUS_TRANSPORT": transport}, timeout=90)),
                     None, f"same store, {transport}")


def _ours_in(directory: str) -> set[str]:
    return {name for name in os.listdir(directory) if "torus" in name}


@pytest.mark.parametrize("device_layer", ["host", "host_device"])
def test_killed_jobs_leave_nothing_behind(tmp_path, device_layer):
    """Every rank SIGKILLed inside a collective, 5 times over (torchrun restarts them): nothing of
    ours is left in /dev/shm or /tmp. host_device: collectives through the host device layer,
    whose arenas are named POSIX shared memory."""
    before = (_ours_in("/dev/shm"), _ours_in("/tmp"))
    env = {"RESTARTS": "5", "TORUS_HOST_DEVICE": "on" if device_layer == "host_device" else "off"}
    done, events = _torchrun(tmp_path, ["--standalone", "--max-restarts", "5"], "all_die", env, 2)
    problems = [] if done.returncode == 0 else [f"torchrun exited with {done.returncode}"]
    if sorted(e["rank"] for e in events if e["event"] == "done") != [0, 1]:
        problems.append(f"the last attempt did not finish: {events}")
    kills = sum(1 for e in events if e["event"] == "kill")
    if kills < 5:
        problems.append(f"only {kills} ranks were killed")
    after = (_ours_in("/dev/shm"), _ours_in("/tmp"))
    for where, old, new in zip(("/dev/shm", "/tmp"), before, after):
        if new - old:
            problems.append(f"left in {where}: {sorted(new - old)}")
    if problems:
        pytest.fail("\n".join(problems) + f"\nstderr:\n{done.stderr[-6000:]}")


@pytest.mark.parametrize("transport", ["auto", "shm+ofi"])
@pytest.mark.parametrize("victims", ["3", "2,3"], ids=["a_rank", "a_whole_host"])
def test_torchrun_restart_across_emulated_hosts(cluster_available, tmp_path, victims, transport):
    """2 emulated hosts x 2 ranks (shm inside each, TCP or OFI between), torchrun's static
    rendezvous with --max-restarts 1 on each host: rank 3, or both ranks of host 1, SIGKILLed
    between steps; both hosts restart and the second attempt trains to the end."""
    if "ofi" in transport and harness.without_ofi():
        pytest.skip(harness.without_ofi())
    out = tmp_path / "events.jsonl"
    status, output, _ = run_cluster(
        ["--hosts", "2", "--nproc-per-host", "2", "--max-restarts", "1", "--env", f"OUT={out}",
         "--env", f"TORUS_TRANSPORT={transport}", "--env", "TORUS_OFI_PROVIDER=tcp",
         "--env", "KILL_AT=between_steps", "--env", f"KILL_RANK={victims}", "--", JOBS, "restart"], tmp_path)
    events = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    finished = [e for e in events if e["event"] == "done" and e["attempt"] == 1]
    problems = [] if status == 0 else [f"the cluster's hosts exited with {status}"]
    if sorted(e["rank"] for e in finished) != [0, 1, 2, 3] or not all(e["replica_equal"] for e in finished):
        problems.append(f"the second attempt did not finish with equal replicas: {finished}")
    _report_restart(events, f"2 hosts over {transport}, ranks {victims} killed")
    if problems:
        pytest.fail("\n".join(problems) + f"\n{output[-6000:]}")

