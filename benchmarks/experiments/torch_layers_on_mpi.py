"""What torch.distributed's Python layers cost a small call when ranks share cores (issue 42,
part 3): Open MPI's 4 KiB allreduce timed as OSU does (its barrier, then the call), alone and
with the CPU time that dist.barrier and dist.all_reduce spend above their backend added around
each, beside torus through dist.* and through torch.ops.torus, in the same processes, the modes
taking turns round by round.

The layers' cost is measured first, in rank 0 alone on a one-rank torus group (the others wait):
dist.barrier() less the group's barrier().wait(), and dist.all_reduce less the backend's
allreduce, each the best of 5 rounds of 20000 calls. "Open MPI + torch's layers" spends half of
each before its MPI call and half after, by a busy loop.

A call's time is the slowest rank's (end - start), and a mode's the median over calls, as
`python -m torch_torus.bench --timing osu` counts them. Needs mpi4py (the Open MPI venv of
benchmarks/osu_interleaved.py):

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=. \\
      /work/ompi/bin/mpiexec --oversubscribe -n 4 /work/ompi/bin/python \\
      benchmarks/experiments/torch_layers_on_mpi.py --rounds 5 --calls 400
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import torch_torus  # noqa: F401 (registers the backend and torch.ops.torus)
from op_floor import best_microseconds  # this directory is on the path when run as a script


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def best_seconds(call) -> float:
    return best_microseconds(call) / 1e6


def layer_costs(tensor: torch.Tensor) -> tuple[float, float]:
    """Seconds per call that dist.barrier and dist.all_reduce spend above their backend, on a
    one-rank group of this rank."""
    (alone, _) = dist.new_subgroups(group_size=1)
    backend = alone._get_backend(torch.device("cpu"))
    barrier_options, allreduce_options = dist.BarrierOptions(), dist.AllreduceOptions()
    barrier_options.asyncOp = allreduce_options.asyncOp = False
    barrier = best_seconds(lambda: dist.barrier(group=alone)) - best_seconds(
        lambda: alone.barrier(barrier_options).wait())
    allreduce = best_seconds(lambda: dist.all_reduce(tensor, group=alone)) - best_seconds(
        lambda: backend.allreduce([tensor], allreduce_options).wait())
    return barrier, allreduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--bytes", type=int, default=4096)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    dist.init_process_group("torus", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    tensor = torch.ones(args.bytes // 4)
    array = tensor.numpy()

    if rank == 0:
        costs = layer_costs(tensor)
    else:
        costs = None
        dist.new_subgroups(group_size=1)  # a collective call: every rank makes it
    barrier_cost, allreduce_cost = comm.bcast(costs)

    name = dist.group.WORLD.group_name
    all_reduce_ = torch.ops.torus.all_reduce_

    world, barrier_options = dist.group.WORLD, dist.BarrierOptions()
    barrier_options.asyncOp = False

    def group_barrier():
        world.barrier(barrier_options).wait()

    def mpi_barrier():
        comm.Barrier()

    def mpi_call():
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)

    def mpi_barrier_layers():
        busy(barrier_cost / 2)
        comm.Barrier()
        busy(barrier_cost / 2)

    def mpi_call_layers():
        busy(allreduce_cost / 2)
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        busy(allreduce_cost / 2)

    modes = {
        "Open MPI": (mpi_barrier, mpi_call),
        "Open MPI + torch's layers": (mpi_barrier_layers, mpi_call_layers),
        "torus, dist.all_reduce": (dist.barrier, lambda: dist.all_reduce(tensor)),
        "torus, torch.ops.torus": (dist.barrier, lambda: all_reduce_(tensor, name, "sum")),
        "torus, torch.ops.torus after MPI's barrier": (mpi_barrier, lambda: all_reduce_(tensor, name, "sum")),
        "Open MPI after torus's dist.barrier": (dist.barrier, mpi_call),
        "Open MPI after torus's barrier without torch's layers": (group_barrier, mpi_call),
    }
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        order = list(modes)
        order = order[round_index % len(order):] + order[:round_index % len(order)]
        for mode in order:
            barrier, call = modes[mode]
            for _ in range(20):
                barrier()
                call()
            spans = np.empty(args.calls)
            for i in range(args.calls):
                barrier()
                start = time.perf_counter()
                call()
                spans[i] = time.perf_counter() - start
            slowest = np.empty_like(spans) if rank == 0 else None
            comm.Reduce(spans, slowest, op=MPI.MAX, root=0)
            if rank == 0:
                results[mode].append(float(np.median(slowest)) * 1e6)
    if rank == 0:
        print(f"# {size} ranks, {args.bytes} B, osu timing; torch's layers: dist.barrier "
              f"{barrier_cost * 1e6:.2f} us and dist.all_reduce {allreduce_cost * 1e6:.2f} us per call "
              "above their backend (rank 0, one-rank group)")
        print("| mode | median over rounds (us) | each round (us) |")
        print("|---|---|---|")
        for mode, values in results.items():
            print(f"| {mode} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
