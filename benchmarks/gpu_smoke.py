"""The GPU check's first minute: does one small collective on device tensors finish at all?

1 rank, then 2 ranks: init_process_group("torus"), one 4 KiB all_reduce sync, one async with
wait(), one async with get_future().then().wait(), each checked; every rank prints what it is
about to do before it does it. All of it is bounded (--bound, default 20 s per world size). On a
hang the parent names, for every rank, the last thing it started ("rank 1 hangs in: async
all_reduce: wait()"), dumps each stuck rank's Python stacks (faulthandler, SIGUSR1) and native
stacks (py-spy dump --native, else cuda-gdb or gdb in batch mode, else the kernel's view under
/proc), kills them, and exits 1, so that the long steps are skipped.

    python benchmarks/gpu_smoke.py --device cuda          # on the GPU machine
    python benchmarks/gpu_smoke.py --device host          # here: the host device layer
    python benchmarks/gpu_smoke.py --device host --self-test-hang   # the hang report, on purpose
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

COUNT = 1024  # float32: 4 KiB
STEP = "SMOKE-STEP "


def say(rank: int, what: str) -> None:
    print(f"{STEP}rank {rank}: {what}", flush=True)


def worker() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device_kind = os.environ["SMOKE_DEVICE"]
    say(rank, "import torch, torch_torus")
    import torch
    import torch.distributed as dist

    import torch_torus  # noqa: F401 - registers "torus"

    if device_kind == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    say(rank, "init_process_group")
    dist.init_process_group("torus", rank=rank, world_size=size)
    expected = float(size * (size + 1) // 2)

    def check(t, what):
        got = t.cpu()
        if not bool((got == expected).all()):
            raise SystemExit(f"rank {rank}: {what} gave {got[:4].tolist()}, expected {expected}")

    t = torch.full((COUNT,), float(rank + 1), device=device)
    say(rank, "sync all_reduce")
    started = time.perf_counter()
    dist.all_reduce(t)
    check(t, "sync all_reduce")
    say(rank, f"sync all_reduce ok in {1e3 * (time.perf_counter() - started):.1f} ms")

    t = torch.full((COUNT,), float(rank + 1), device=device)
    say(rank, "async all_reduce: issue")
    work = dist.all_reduce(t, async_op=True)
    say(rank, "async all_reduce: wait()")
    work.wait()
    check(t, "async all_reduce")
    say(rank, "async all_reduce: is_completed()")
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    if not work.is_completed():
        raise SystemExit(f"rank {rank}: is_completed() still False 10 s after wait() returned")

    t = torch.full((COUNT,), float(rank + 1), device=device)
    say(rank, "async all_reduce: get_future().then().wait()")
    doubled = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2).wait()
    check(doubled / 2, "future then")
    if device.type == "cuda":
        say(rank, "torch.cuda.synchronize()")
        torch.cuda.synchronize()
    say(rank, "destroy_process_group")
    dist.destroy_process_group()
    say(rank, "done")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def native_stacks(pid: int) -> str:
    """Every thread's native stack of `pid`, by the best tool at hand."""
    tools = []
    if shutil.which("py-spy"):
        tools.append(["py-spy", "dump", "--native", "--pid", str(pid)])
    for debugger in ("cuda-gdb", "gdb"):
        if shutil.which(debugger):
            tools.append([debugger, "-p", str(pid), "-batch", "-ex", "thread apply all bt"])
    for command in tools:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            print(f"    {command[0]} failed: {error}")
            continue
        if done.returncode == 0 and done.stdout.strip():
            return f"$ {' '.join(command)}\n{done.stdout}"
        print(f"    {command[0]} gave nothing (exit {done.returncode}): {done.stderr.strip()[:300]}")
    lines = ["(no py-spy, cuda-gdb or gdb worked: the kernel's view of each thread)"]
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        base = f"/proc/{pid}/task/{tid}"
        parts = []
        for name in ("comm", "wchan", "syscall"):
            try:
                with open(f"{base}/{name}") as f:
                    parts.append(f"{name}={f.read().strip()}")
            except OSError:
                pass
        lines.append(f"  thread {tid}: " + " ".join(parts))
    return "\n".join(lines)


def run(size: int, args) -> bool:
    env = dict(os.environ, WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               SMOKE_DEVICE="cuda" if args.device == "cuda" else "host", OMP_NUM_THREADS="1")
    if args.device == "host":
        env["TORUS_HOST_DEVICE"] = "stall:done" if args.self_test_hang else "on"
        if args.self_test_hang:
            env["TORUS_DEVICE_STALL_TIMEOUT"] = f"{3 * args.bound}s"  # longer than the bound: a hang
    logs = [os.path.join(args.out, f"smoke-ws{size}-rank{r}.log") for r in range(size)]
    ranks = []
    for r in range(size):
        with open(logs[r], "w") as log:
            ranks.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                          env=dict(env, RANK=str(r)), stdout=log, stderr=subprocess.STDOUT))
    print(f"== {size} rank(s) on {args.device}, bound {args.bound:g} s")
    deadline = time.monotonic() + args.bound
    while time.monotonic() < deadline and any(p.poll() is None for p in ranks):
        time.sleep(0.1)
    stuck = [r for r, p in enumerate(ranks) if p.poll() is None]
    for r in stuck:
        ranks[r].send_signal(signal.SIGUSR1)  # each stuck rank's Python stacks, into its log
    if stuck:
        time.sleep(1)
        for r in stuck:
            print(f"-- native stacks of rank {r} (pid {ranks[r].pid}):")
            print(native_stacks(ranks[r].pid))
    for p in ranks:
        if p.poll() is None:
            p.kill()
        p.wait()
    ok = not stuck and all(p.returncode == 0 for p in ranks)
    for r, path in enumerate(logs):
        with open(path, errors="replace") as f:
            text = f.read()
        steps = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith(STEP)]
        last = steps[-1] if steps else "(nothing printed: before Python started?)"
        if r in stuck:
            print(f"rank {r} HANGS in: {last}")
        elif ranks[r].returncode != 0:
            print(f"rank {r} FAILED (exit {ranks[r].returncode}) in: {last}")
        else:
            print(f"rank {r} ok: " + "; ".join(s for s in steps if " ok " in s or s == "done"))
        if not ok:
            print(f"-- rank {r}'s output ({path}):")
            print(text[-6000:])
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--bound", type=float, default=20.0, help="seconds per world size (default 20)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where the ranks' logs go")
    parser.add_argument("--self-test-hang", action="store_true",
                        help="host device only: make wait() hang (stall:done) to show the hang report")
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    if args.self_test_hang and args.device != "host":
        parser.error("--self-test-hang needs --device host")
    os.makedirs(args.out, exist_ok=True)
    for size in (1, 2):
        if not run(size, args):
            print(f"SMOKE FAILED at {size} rank(s): the long steps would hang or fail the same way")
            return 1
    print("SMOKE PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
