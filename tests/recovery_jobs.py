"""Jobs that tests/test_recovery.py starts under torchrun: a rank dies, and the job recovers.

restart: DDP on a small net for STEPS steps; on the first attempt the ranks KILL_RANK (comma
separated) kill themselves with SIGKILL at step KILL_STEP, at the point KILL_AT names (creation: before it creates its group;
collective: inside a 64 MiB all_reduce; between_steps: before the step's forward). torchrun
restarts every rank; the next attempt must create its group and train to the end.

in_process: rank size-1 exits after the first all_reduce; the survivors catch the error,
destroy the group, and create a new one of the survivors on a new store prefix.

all_die: every rank is SIGKILLed inside a collective, RESTARTS times over; then one attempt ends.

Each rank appends one JSON line to OUT per event (times are time.time(), comparable across
ranks of one host)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import torch_torus  # noqa: F401  (registers the backend)


def record(**fields) -> None:
    with open(os.environ["OUT"], "a") as f:
        f.write(json.dumps({"at": time.time(), "pid": os.getpid(), **fields}) + "\n")


def resources() -> dict:
    """What the process holds: open fds, threads, shared mappings of ours."""
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "torus" in line)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "torus_maps": maps}


def kill_self() -> None:
    record(event="kill", rank=int(os.environ["RANK"]))
    os.kill(os.getpid(), signal.SIGKILL)


def restart() -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    kill_at, kill_ranks = os.environ.get("KILL_AT", "none"), os.environ.get("KILL_RANK", "2").split(",")
    kill_step, steps = int(os.environ.get("KILL_STEP", "5")), int(os.environ.get("STEPS", "10"))
    dying = attempt == 0 and str(rank) in kill_ranks
    if dying and kill_at == "creation":
        kill_self()
    dist.init_process_group("torus", timeout=datetime.timedelta(seconds=60))
    record(event="group", attempt=attempt, rank=rank)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    big = torch.ones(1 << 24)
    for step in range(steps):
        if step == kill_step:
            if dying and kill_at == "between_steps":
                kill_self()
            if dying and kill_at == "collective":
                threading.Timer(0.02, kill_self).start()
            dist.all_reduce(big)  # the others are inside it when the dying rank goes
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = model(torch.randn(16, 32, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        record(event="step", attempt=attempt, rank=rank, step=step)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, 0)
    record(event="done", attempt=attempt, rank=rank, replica_equal=bool(torch.equal(first, flat)))
    dist.destroy_process_group()


def in_process() -> None:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False,
                         timeout=datetime.timedelta(seconds=30))
    timeout = datetime.timedelta(seconds=60)
    before = None
    for cycle in range(int(os.environ.get("CYCLES", "3"))):
        dist.init_process_group("torus", store=dist.PrefixStore(f"cycle{cycle}", base), rank=rank,
                                world_size=size, timeout=timeout)
        t = torch.ones(1 << 20)
        dist.all_reduce(t)
        dist.destroy_process_group()
        if cycle == 0:
            before = resources()
    record(event="cycles", rank=rank, before=before, after=resources())
    dist.init_process_group("torus", store=dist.PrefixStore("victim", base), rank=rank, world_size=size,
                            timeout=timeout)
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    if rank == size - 1:
        record(event="exit", rank=rank)
        sys.stdout.flush()
        os._exit(0)
    try:
        for _ in range(1000):
            dist.all_reduce(t)
        record(event="no_error", rank=rank)
        return
    except dist.DistBackendError as error:
        failed_at = time.monotonic()
        record(event="error", rank=rank, error=str(error)[:300])
    dist.destroy_process_group()
    destroyed_at = time.monotonic()
    dist.init_process_group("torus", store=dist.PrefixStore("survivors", base), rank=rank, world_size=size - 1,
                            timeout=timeout)
    u = torch.ones(1 << 20)
    dist.all_reduce(u)
    record(event="recovered", rank=rank, destroy_ms=1e3 * (destroyed_at - failed_at),
           recovered_ms=1e3 * (time.monotonic() - failed_at), value=u[0].item(), expected=float(size - 1))
    dist.destroy_process_group()


def all_die() -> None:
    """Every rank SIGKILLs itself inside a 64 MiB all_reduce, on attempts before the last one
    (torchrun restarts them RESTARTS times); the last attempt finishes."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("torus", timeout=datetime.timedelta(seconds=60))
    big = torch.ones(1 << 24)
    dist.all_reduce(big)
    if attempt < int(os.environ["RESTARTS"]):
        threading.Timer(0.01, kill_self).start()
        dist.all_reduce(big)
        time.sleep(60)
    record(event="done", attempt=attempt, rank=dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    {"restart": restart, "in_process": in_process, "all_die": all_die}[sys.argv[1]]()
