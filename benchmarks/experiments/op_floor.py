"""The per-call floor of a registered op, in one process: torch.ops.torus.all_reduce_ on a
one-rank torus group against an aten in-place op of the same size (torch's dispatcher and a
trivial kernel), dist.all_reduce on the same group, and mpi4py's Allreduce on COMM_SELF (needs
mpi4py). 4 KiB of float32, best of 5 rounds of 20000 calls, µs per call.

    OMP_NUM_THREADS=1 python benchmarks/experiments/op_floor.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import torch_torus  # noqa: F401 (registers the backend and torch.ops.torus)


def best_microseconds(call, calls: int = 20000, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("torus", rank=0, world_size=1)
    tensor = torch.ones(1024)
    name = dist.group.WORLD.group_name
    all_reduce_, abs_ = torch.ops.torus.all_reduce_, torch.ops.aten.abs_
    rows = [("torch.ops.aten.abs_ (the dispatcher's floor)", lambda: abs_(tensor)),
            ("torch.ops.torus.all_reduce_, one-rank group", lambda: all_reduce_(tensor, name, "sum")),
            ("dist.all_reduce, one-rank group", lambda: dist.all_reduce(tensor))]
    try:
        from mpi4py import MPI

        array = tensor.numpy()
        rows.append(("mpi4py COMM_SELF.Allreduce(IN_PLACE)", lambda: MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, array)))
    except ImportError:
        print("mpi4py is not installed: no MPI row")
    for label, call in rows:
        print(f"{label:<48} {best_microseconds(call):6.2f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
