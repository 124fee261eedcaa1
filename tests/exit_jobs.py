"""Two-rank jobs that end without destroy_process_group, for tests/test_clean_exit.py.

python tests/exit_jobs.py --transport shm --jobs 20 --scratch DIR

Every rank creates its default group over the transport, runs sync and async all_reduces of 1K and
3M elements (results checked), prints, and ends as a script does: its interpreter finalizes with the
group alive. How each job ends cycles through ENDINGS (or --endings): right after its waited calls;
with an async 3M all_reduce still in flight; with one whose future has a Python callback; with a
second group, async work in flight on both groups and callbacks on both; with a daemon thread inside
sync all_reduces of 1M elements, back to back, as the main thread calls sys.exit(0). A callback checks the value and leaves a
file in DIR, so that the work in flight is seen to complete before the process ends.

Starting python and importing torch costs a rank about 2 s of CPU, which 20 jobs over three
transports cannot afford on a small machine; so this process imports torch and torch_torus once
and forks each rank (as DataLoader's workers are), and each rank then runs its job and finalizes
its own interpreter as a script does. Jobs run a few at a time, each rank bounded by --job-timeout
(SIGKILLed past it). Prints one JSON line per rank: job, rank, ending, status (the exit code, or
minus the signal), its stderr's tail, and whether its callbacks' files are there."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import torch_torus  # noqa: F401  (registers the backend)

ENDINGS = ("waited", "in_flight", "callback", "two_groups", "daemon_thread")
SMALL, LARGE = 1 << 10, 3 * (1 << 20)
# What each ending's callbacks leave: one file per group.
CALLBACKS = {"waited": 0, "in_flight": 0, "callback": 1, "two_groups": 2, "daemon_thread": 0}
# What a script holds at its end, as its globals: the tensors, works and futures in flight.
HELD: list = []


def _check(tensor: torch.Tensor, expected: float, what: str) -> None:
    if not bool((tensor == expected).all()):
        sys.stderr.write(f"{what}: expected {expected}, got {tensor.unique()[:4].tolist()}\n")
        sys.exit(3)


def _leave_mark(path: str, expected: float):
    """A callback for a future of all_reduce: checks the value, then creates `path`."""
    def mark(future):
        (tensor,) = future.value()
        if bool((tensor == expected).all()):
            open(path, "w").close()
        return tensor

    return mark


def _all_reduce_forever() -> None:
    t = torch.ones(1 << 20)
    while True:
        dist.all_reduce(t)


def run_job(rank: int, job: int, ending: str, transport: str, scratch: str) -> None:
    os.environ["TORUS_TRANSPORT"] = transport
    dist.init_process_group("torus", init_method=f"file://{scratch}/store.{job}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    expected = 1.0 + 2.0  # ranks contribute rank + 1
    for count in (SMALL, LARGE):
        t = torch.full((count,), rank + 1.0)
        dist.all_reduce(t)
        _check(t, expected, f"sync all_reduce of {count}")
        t = torch.full((count,), rank + 1.0)
        dist.all_reduce(t, async_op=True).wait()
        _check(t, expected, f"async all_reduce of {count}")
    if ending == "daemon_thread":
        threading.Thread(target=_all_reduce_forever, daemon=True).start()
        time.sleep(0.3)
        print(f"rank {rank} of job {job}: done ({ending})", flush=True)
        sys.exit(0)
    # The groups left with work in flight (None: the default group).
    groups = {"waited": [], "in_flight": [None], "callback": [None]}.get(ending)
    if ending == "two_groups":
        groups = [None, dist.new_group([0, 1])]
    for index, group in enumerate(groups):
        t = torch.full((LARGE,), rank + 1.0)
        work = dist.all_reduce(t, group=group, async_op=True)
        HELD.append((t, work))
        if ending != "in_flight":
            HELD.append(work.get_future().then(_leave_mark(f"{scratch}/mark.{job}.{rank}.{index}", expected)))
    print(f"rank {rank} of job {job}: done ({ending})", flush=True)


def _fork_rank(rank: int, job: int, ending: str, args) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        err = os.open(f"{args.scratch}/stderr.{job}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        out = os.open(os.devnull, os.O_WRONLY)
        os.dup2(out, 1)
        os.dup2(err, 2)
    return pid


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-1500:]
    except OSError:
        return ""


def serve(args) -> tuple[int, int, str] | None:
    """In this process: runs the jobs and prints their outcomes; None. In a forked rank: the
    (rank, job, ending) it runs."""
    pending = list(range(args.jobs))
    running: dict[int, tuple[int, int, float]] = {}  # pid -> job, rank, deadline
    while pending or running:
        while pending and len(running) < 2 * args.concurrency:
            job = pending.pop(0)
            ending = args.endings[job % len(args.endings)]
            for rank in (0, 1):
                pid = _fork_rank(rank, job, ending, args)
                if pid == 0:
                    return rank, job, ending
                running[pid] = (job, rank, time.monotonic() + args.job_timeout)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for late, (job, rank, deadline) in running.items():
                if now > deadline:
                    os.killpg(late, signal.SIGKILL)
            time.sleep(0.05)
            continue
        job, rank, _ = running.pop(pid)
        ending = args.endings[job % len(args.endings)]
        marks = [os.path.exists(f"{args.scratch}/mark.{job}.{rank}.{i}") for i in range(CALLBACKS[ending])]
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"job": job, "rank": rank, "ending": ending, "status": code, "callbacks_ran": all(marks),
                          "stderr": "" if code == 0 else _tail(f"{args.scratch}/stderr.{job}.{rank}")}),
              flush=True)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", required=True)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=3, help="jobs running at once")
    parser.add_argument("--job-timeout", type=float, default=60.0)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--endings", nargs="+", choices=ENDINGS, default=list(ENDINGS))
    args = parser.parse_args()
    forked = serve(args)
    if forked is not None:
        run_job(*forked, args.transport, args.scratch)
        # ... and the rank's interpreter ends here, with its group alive, as a script's does.


if __name__ == "__main__":
    main()
