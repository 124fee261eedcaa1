"""Measure every applicable allreduce algorithm on the running job and write a tuning file.

    torchrun --nproc-per-node 4 -m torch_torus.tune -b 4K -e 16M -o torus_tuning.json
    torchrun --nproc-per-node 4 -m torch_torus.tune --timing osu -o torus_tuning.json  # calls after a barrier
    TORUS_TUNING_FILE=torus_tuning.json torchrun --nproc-per-node 4 train.py
    python -m torch_torus.tune --print torus_tuning.json     # as TORUS_ALLREDUCE range strings

The algorithms are those `auto` chooses among for this job (torch_torus.selection's
allreduce_candidates: the torus only where the job has a grid), each in its own process group
with the job's other settings (TORUS_TORUS_DIMS, TORUS_TORUS_INNER, TORUS_CHUNK_BYTES, ...).
At a size where an algorithm's group would run another (one_shot above its shared-memory slot
runs two_shot) it is not measured: the file holds null there, and the table cannot choose it.
At each size the algorithms are timed as the bench times its contenders (torch_torus.bench.timing):
in turn, for several rounds in a new order each, so that drift of the machine hits all alike; an
algorithm's time at a size is the best round's (interference from other work only ever adds
time), each round the mean of its calls on the slowest rank: --iters calls in the first round,
and after it as many as last --min-round-ms, so that small sizes, where one call is a few
scheduling delays, average over more. With --timing osu each call is timed alone after a barrier,
as OSU's osu_allreduce does and as a training step's ranks arrive from compute, and an
algorithm's time is the median over its calls of all rounds of the slowest rank's time; the file's
entry records which timing it was tuned on. Rank 0 shows a progress bar on a terminal.

The file keeps one entry per job layout (world size, torus grid, ranks per host, transport); tuning a
layout again replaces its entry and keeps the others. Runs under torchrun or any launcher that
sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from tqdm import tqdm

from . import tuning
from .bench.memory_bound import host_memory_bandwidth
from .bench.sizes import human_size, parse_size, size_steps
from .bench.timing import TIMINGS, RoundPlan, time_contenders
from .config import Options, resolve
from .selection import allreduce_candidates
from .topology import choose_grid, choose_transport, host_identity


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torch_torus.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("4K"),
                        help="smallest size (default: 4K)")
    parser.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("16M"),
                        help="largest size (default: 16M)")
    parser.add_argument("-f", "--factor", type=int, default=4,
                        help="size step factor (default: %(default)s)")
    parser.add_argument("-n", "--iters", type=int, default=5, help="timed calls per round (default: %(default)s)")
    parser.add_argument("-w", "--warmup", type=int, default=2,
                        help="untimed calls before each round (default: %(default)s)")
    parser.add_argument("--min-round-ms", type=float, default=50.0,
                        help="after the first round, more calls per round where --iters would take "
                             "less than this (small sizes), up to 100x --iters (default: %(default)s)")
    parser.add_argument("-r", "--rounds", type=int, default=2,
                        help="rounds per size and algorithm; the best counts, with --timing osu the "
                             "median of all rounds' calls (default: %(default)s)")
    parser.add_argument("--timing", choices=list(TIMINGS), default="loop",
                        help="loop: calls back to back, the mean per call on the slowest rank; osu: a "
                             "barrier before each call, timed alone, the median call on the slowest "
                             "rank, as OSU's osu_allreduce (default: %(default)s)")
    parser.add_argument("-o", "--output", default=None,
                        help="tuning file to write (default: $TORUS_TUNING_FILE, else torus_tuning.json)")
    parser.add_argument("--print", dest="print_file", metavar="FILE",
                        help="print FILE's entries as TORUS_ALLREDUCE range strings and exit (no launcher needed)")
    return parser


def print_file(path: str) -> None:
    for entry in tuning.read(path):
        print(f"# {entry.layout}; timing {entry.timing}")
        print(f'TORUS_ALLREDUCE="{entry.range_string}"')


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.print_file:
        print_file(args.print_file)
        return
    if (args.min_bytes > args.max_bytes or args.factor < 2 or args.iters < 1 or args.warmup < 0 or args.rounds < 1
            or args.min_round_ms < 0):
        parser.error("need --min-bytes <= --max-bytes, --factor >= 2, --iters >= 1, --warmup >= 0, --rounds >= 1, "
                     "--min-round-ms >= 0")
    output = args.output or os.environ.get(tuning.VARIABLE) or "torus_tuning.json"

    import torch_torus  # registers the backend

    dist.init_process_group(backend="gloo")  # barriers and gathering times, alike for every algorithm
    bootstrap = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    values = resolve(None)
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, values["host_id"] or host_identity(), group=bootstrap)
    grid = choose_grid(world_size, hosts, values["torus_dims"])
    transport = choose_transport(values["transport"], hosts)
    layout = tuning.Layout.of(hosts, grid, transport)
    algorithms = allreduce_candidates(grid, transport)
    # Each algorithm fixed for every size; tuning_file="" so that an existing file plays no part.
    groups = {a: dist.new_group(backend="torus", pg_options=Options(allreduce=a, tuning_file=""))
              for a in algorithms}
    sizes = size_steps(args.min_bytes, args.max_bytes, args.factor)
    # On one host, what its memory moves: the cost model's shared-memory machine scales with it.
    memory = host_memory_bandwidth(bootstrap) if len(set(hosts)) == 1 else None
    if rank == 0:
        print(f"# torch_torus.tune: {layout}; algorithms {', '.join(algorithms)}; sizes "
              f"{human_size(sizes[0])}-{human_size(sizes[-1])} x{args.factor}; {args.rounds} rounds of "
              f"{args.iters} calls after {args.warmup} warmup; timing {args.timing}: {TIMINGS[args.timing]}",
              flush=True)
        if memory is not None:
            print(f"# host memory: {memory.describe()}", flush=True)

    elements = {size: max(1, size // 4) for size in sizes}
    runs = {size: [a for a in algorithms if torch_torus.algorithm_for("allreduce", 4 * elements[size], groups[a]) == a]
            for size in sizes}
    # On rank 0's terminal only: a log (mpiexec, srun, a redirect) gets the table at the end.
    progress = tqdm(total=sum(len(r) for r in runs.values()) * args.rounds, file=sys.stderr, unit="round",
                    disable=rank != 0 or not sys.stderr.isatty())
    plan = RoundPlan.of(args)
    time_us: dict[str, list[float | None]] = {a: [] for a in algorithms}
    for size in sizes:
        measured = runs[size]
        tensor = torch.zeros(elements[size], dtype=torch.float32)
        calls = [lambda group=groups[a], tensor=tensor: dist.all_reduce(tensor, group=group) for a in measured]

        def timed(index: int) -> None:
            progress.set_description(f"{human_size(size)} {measured[index]}", refresh=False)
            progress.update()

        barriers = [lambda group=groups[a]: dist.barrier(group=group) for a in measured]
        seconds = [m.seconds for m in time_contenders(calls, plan, bootstrap, timed=timed, barriers=barriers)]
        for algorithm in algorithms:
            time_us[algorithm].append(seconds[measured.index(algorithm)] * 1e6 if algorithm in measured else None)
    progress.close()

    if rank == 0:
        about = {"created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "torch": torch.__version__, "torus_inner": values["torus_inner"],
                 "chunk_bytes": values["chunk_bytes"], "iters": args.iters, "rounds": args.rounds,
                 "min_round_ms": args.min_round_ms, "timing": args.timing}
        if memory is not None:
            about["host_memory"] = memory.to_json()
        entry = tuning.make_entry(layout, sizes, time_us, about)
        tuning.write(output, entry)
        time_is = "median call of the slowest rank" if args.timing == "osu" else "best round"
        print(f"# {'size':>10} " + " ".join(f"{a:>18}" for a in algorithms) + "   fastest"
              + f"   (us, {time_is}; -: the algorithm's group runs another at that size)")
        for i, size in enumerate(sizes):
            cells = (f"{time_us[a][i]:>18.1f}" if time_us[a][i] is not None else f"{'-':>18}" for a in algorithms)
            print(f"  {size:>10} " + " ".join(cells) + f"   {min(runs[size], key=lambda a: time_us[a][i])}")
        print(f"# wrote {output}: {layout}")
        print(f'TORUS_ALLREDUCE="{entry["allreduce"]}"', flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
