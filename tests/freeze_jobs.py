"""A node that freezes, for tests/test_freeze.py and benchmarks/frozen_node.py: python
tests/freeze_jobs.py store PORT, or python tests/freeze_jobs.py rank RANK SIZE PORT STORE_PID MODE
[BACKEND] (torus by default; gloo to compare).

The group's TCPStore is served by a process of its own (`store`), as on a cluster where it lives on
another host. Each rank creates a group of BACKEND over it (timeout TIMEOUT_S) and runs 1 MiB
all_reduces. At step FREEZE_AT the last rank freezes (SIGSTOP: a node that hangs, its sockets open,
answering nothing), and with MODE "store-frozen" it freezes the store's process first (its host hung
too). The other ranks, in MODE ending "-abort", call the group's abort() from a watchdog thread once
their all_reduce has not returned for ABORT_AFTER_S, and report how long abort() took. Each survivor
prints one JSON line (how long after its last completed step it failed, the error, abort's time)
and exits without destroying its group, as a script that fails does."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time

TIMEOUT_S = 4.0
FREEZE_AT = 20
ABORT_AFTER_S = 1.0


def serve_store(port: int) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    print("serving", flush=True)
    while store is not None:
        time.sleep(3600)


def run_rank(rank: int, size: int, port: int, store_pid: int, mode: str, backend: str = "torus") -> None:
    import torch
    import torch.distributed as dist

    import torch_torus  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group = dist.group.WORLD
    t = torch.ones(1 << 18)
    last = time.monotonic()
    report = {"rank": rank}
    if mode.endswith("-abort"):
        def watchdog():
            while time.monotonic() - last < ABORT_AFTER_S:
                time.sleep(0.05)
            began = time.monotonic()
            group.abort()
            report["abort_s"] = time.monotonic() - began
        threading.Thread(target=watchdog, daemon=True).start()
    for step in range(1, 10_000):
        if rank == size - 1 and step == FREEZE_AT:
            if mode.startswith("store-frozen"):
                os.kill(store_pid, signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            dist.all_reduce(t, group=group)
        except Exception as error:  # noqa: BLE001
            report.update(failed_after_s=time.monotonic() - last, step=step, error=str(error)[:2000],
                          type=type(error).__name__)
            break
        last = time.monotonic()
    while mode.endswith("-abort") and "abort_s" not in report and time.monotonic() - last < 30:
        time.sleep(0.05)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "store":
        serve_store(int(sys.argv[2]))
    else:
        run_rank(*map(int, sys.argv[2:6]), *sys.argv[6:8])
