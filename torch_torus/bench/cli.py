"""The command line of `python -m torch_torus.bench`: arguments, and the run from the bootstrap
group to the report."""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist

from .collectives import COLLECTIVES, DTYPES, REDUCE_OPS, CheckPattern
from .contenders import (MPI_CONTENDER, MPI_LAUNCH_EXAMPLE, MPI_REDUCE_OPS, import_backends,
                         init_env_under_mpiexec, parse_contenders, start_mpi_contender)
from .measure import counts_to_measure, measure_size
from .report import Table, header, summary, write_json, write_plot
from .sizes import parse_size
from .memory_bound import host_memory_bandwidth
from .timing import TIMINGS, DeviceCopy, device_copy_bandwidth


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch_torus.bench",
        description="Measure a torch.distributed collective over a range of sizes for several\n"
                    "backends side by side, with nccl-tests' columns. Launch one process per\n"
                    "rank: torchrun (or any launcher setting MASTER_ADDR, MASTER_PORT, RANK and\n"
                    "WORLD_SIZE), mpiexec of MPICH or Open MPI (needs mpi4py), or srun.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  torchrun --nproc-per-node 4 -m torch_torus.bench -b 4K -e 64M --check\n"
               "  torchrun --nproc-per-node 8 -m torch_torus.bench --plot busbw.png \\\n"
               "      --backends 'torus:allreduce=ring;torus:allreduce=torus,torus_dims=2x4;gloo'\n"
               "  torchrun --nproc-per-node 4 -m torch_torus.bench --import-module "
               "oneccl_bindings_for_pytorch --backends ccl,gloo\n"
               f"  {MPI_LAUNCH_EXAMPLE}")
    parser.add_argument("-c", "--collective", choices=list(COLLECTIVES), default="allreduce",
                        help="collective to measure (default: %(default)s)")
    parser.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("4K"),
                        help="smallest size, bytes with optional K/M/G suffix (default: 4K)")
    parser.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"),
                        help="largest size (default: 64M)")
    parser.add_argument("-f", "--factor", type=int, default=2,
                        help="multiply the size by this from one row to the next "
                             "(default: %(default)s)")
    parser.add_argument("-d", "--dtype", choices=list(DTYPES), default="float32",
                        help="element type (default: %(default)s)")
    parser.add_argument("-o", "--op", choices=list(REDUCE_OPS), default="sum",
                        help="reduction for allreduce and reduce_scatter (default: %(default)s; "
                             "avg for floating dtypes only, and gloo has no avg)")
    parser.add_argument("-r", "--root", type=int, default=0,
                        help="source rank of broadcast (default: %(default)s)")
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="timed calls per size and contender (default: %(default)s)")
    parser.add_argument("-w", "--warmup", type=int, default=5,
                        help="untimed calls before them (default: %(default)s)")
    parser.add_argument("-R", "--rounds", type=int, default=1,
                        help="rounds per size: each round times every contender in turn, in a new "
                             "order each round, and a contender's time is its best round's (--timing "
                             "osu: the median of all rounds' calls), so that drift of a shared machine "
                             "hits every contender alike (default: %(default)s)")
    parser.add_argument("--min-round-ms", type=float, default=0.0,
                        help="with --rounds > 1: after the first round, more calls per round where "
                             "--iters would take less than this (small sizes), up to 100x --iters, as "
                             "python -m torch_torus.tune does (default: %(default)s, off)")
    parser.add_argument("--timing", choices=list(TIMINGS), default="loop",
                        help="loop: the calls back to back, time = mean per call on the slowest "
                             "rank (nccl-tests); osu: a barrier of the contender's own before each "
                             "call, timed alone, time = the median call's on the slowest rank, with "
                             "OSU's avg/min/max latency over ranks (osu_allreduce) and, on one host, "
                             "the barrier's exit skew and the call after the last rank's start, as a "
                             "training step's ranks arrive from compute (default: %(default)s)")
    parser.add_argument(
        "--backends", "--backend", dest="backends", action="append", metavar="SPEC",
        help="contenders to compare, separated by ',' or ';' or given by repeating the flag. "
             "A contender is a registered backend name, for torus optionally with options: "
             "'torus:allreduce=ring,chunk_bytes=1M' (keys are the TORUS_* variables in lower "
             "case without the prefix; a oneCCL-style rule such as "
             "'allreduce=recursive_doubling:0-8192;ring:8193-max' may be written whole; quote the "
             "argument in a shell); 'torus:api=op' calls torch.ops.torus.all_reduce_ instead of "
             "torch.distributed (allreduce of CPU tensors). 'mpi' is MPI's own collectives through "
             "mpi4py (under mpiexec only). Default: 'torus,gloo'")
    parser.add_argument("--import-module", action="append", default=[], metavar="MODULE",
                        help="import this module first, for backends it registers "
                             "(e.g. oneccl_bindings_for_pytorch for 'ccl'); repeatable")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the tensors live; cuda uses GPU LOCAL_RANK modulo the GPU "
                             "count, measures rank 0's GPU's device-to-device copy bandwidth "
                             "first and reports each busbw as a share of it (default: %(default)s)")
    parser.add_argument("--alloc", choices=["torch", "backend"], default="torch",
                        help="where the buffers come from, shared by every contender at a size. "
                             "torch: torch.empty (what DDP's buckets are); backend: the first "
                             "contender group's allocate_tensor (c10d's tensor allocation hook, where "
                             "FSDP2 takes its buffers: torus puts CPU tensors in shared memory its "
                             "peers on the host map, and keeps freed ones for reuse up to "
                             "TORUS_SHARED_TENSOR_CACHE) (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="after timing each size, run one more call on known data and count "
                             "wrong elements in #wrong (slower; off by default, as nccl-tests "
                             "-c 0)")
    parser.add_argument("--json", metavar="PATH", help="also write every row to this JSON file")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw busbw against size, one line per contender, to this PNG "
                             "(needs matplotlib)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.contenders = parse_contenders(args.backends or ["torus,gloo"])
    except ValueError as error:
        parser.error(f"--backends: {error}")
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1 or args.min_round_ms < 0:
        parser.error("--iters and --rounds must be at least 1, --warmup and --min-round-ms at least 0")
    if args.op == "avg" and not DTYPES[args.dtype].is_floating_point:
        parser.error("--op avg needs a floating --dtype")
    for contender in args.contenders:
        if contender.api == "op" and (args.collective != "allreduce" or args.device != "cpu"):
            parser.error(f"--backends {contender.label}: torch.ops.torus has all_reduce_ of CPU "
                         f"tensors only, not {args.collective} on {args.device}")
    if any(contender.backend == MPI_CONTENDER for contender in args.contenders):
        # MPI has no average; its buffers are numpy views, and numpy has no bfloat16; the MPIs
        # from PyPI are not CUDA-aware.
        if args.op not in MPI_REDUCE_OPS and COLLECTIVES[args.collective].has_op:
            parser.error(f"--op {args.op}: MPI has no such reduction; the mpi contender offers "
                         f"{', '.join(MPI_REDUCE_OPS)}")
        if args.dtype == "bfloat16":
            parser.error("--dtype bfloat16: the mpi contender passes numpy arrays, and numpy has "
                         "no bfloat16")
        if args.device != "cpu":
            parser.error(f"--device {args.device}: the mpi contender measures CPU tensors only")
    if args.plot:
        # Fail now rather than after a long run.
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib")
    return args


def measured_device_copy(device: torch.device, rank: int, bootstrap: dist.ProcessGroup) -> DeviceCopy:
    """Rank 0 times its GPU's copy bandwidth while the others wait (ranks may share the GPU);
    every rank gets the figure."""
    shared = [device_copy_bandwidth(device) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0, group=bootstrap)
    return shared[0]


def buffer_allocator(alloc: str, contenders, device: torch.device):
    """empty(count, dtype) for --alloc: torch.empty, or the first contender group's
    allocate_tensor; names the contenders when none offers it."""
    if alloc == "torch":
        return lambda count, dtype: torch.empty(count, dtype=dtype, device=device)
    for contender in contenders:
        if contender.group is None:
            continue
        backend = contender.group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            return lambda count, dtype: backend.allocate_tensor(count, dtype=dtype, device=device)
    labels = ", ".join(contender.label for contender in contenders)
    raise SystemExit(f"--alloc backend: no contender ({labels}) allocates tensors on {device}")


def shared_memory_line(stats: dict[str, int]) -> str:
    """What rank 0's shared tensor arena holds after the run (--alloc backend with torus)."""
    mib = 1 << 20
    return (f"# shared tensors on rank 0 after the run: {stats['live_bytes'] / mib:.1f} MiB live, "
            f"{stats['free_bytes'] / mib:.1f} MiB in {stats['free_segments']} freed segments kept for reuse "
            f"(limit {stats['limit_bytes'] / mib:.1f} MiB, TORUS_SHARED_TENSOR_CACHE; peak live "
            f"{stats['peak_live_bytes'] / mib:.1f} MiB); torch_torus.empty_cache() gives them back")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import_backends(args.contenders, args.import_module)
    mpi_launch = init_env_under_mpiexec(args.contenders)

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        synchronize = torch.cuda.synchronize
    else:
        device, synchronize = torch.device("cpu"), lambda: None

    # Bootstrap group: barriers and gathering of times, the same for every contender.
    dist.init_process_group(backend="gloo")
    bootstrap = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not 0 <= args.root < world_size:
        raise SystemExit(f"--root {args.root} is not a rank of {world_size}")
    args.device_copy = measured_device_copy(device, rank, bootstrap) if args.device == "cuda" else None
    # MPI first: an MPI that brings its own libfabric needs it loaded before torus's ofi
    # transport loads the system's under the same name (libfabric.so.1).
    for contender in sorted(args.contenders, key=lambda c: c.backend != MPI_CONTENDER):
        if contender.backend == MPI_CONTENDER:
            start_mpi_contender(contender, mpi_launch)
        else:
            contender.group = dist.new_group(backend=contender.backend,
                                             pg_options=contender.pg_options())
            if contender.backend == "torus":
                import torch_torus

                backend = torch_torus._torus_backend(contender.group, "bench")
                contender.transport = backend.config.transport
                if contender.transport.endswith("ofi"):
                    # Which provider, and which libfabric: an MPI loaded first lends its own.
                    detail = backend.transport_description
                    if contender.transport != "ofi":
                        detail = f"{contender.transport}: {detail}"
                    contender.transport = detail

    args.empty = buffer_allocator(args.alloc, args.contenders, device)

    hostnames: list[str] = [""] * world_size
    dist.all_gather_object(hostnames, socket.gethostname(), group=bootstrap)
    one_host = len(set(hostnames)) == 1
    # Before the first size, while no contender's buffers are in use.
    args.host_memory = host_memory_bandwidth(bootstrap) if one_host and args.device == "cpu" else None
    collective = COLLECTIVES[args.collective](world_size, rank, args.root)
    pattern = CheckPattern.make(args.op, world_size)
    table = Table(collective, args)

    def report(lines: list[str]) -> None:
        if rank == 0:
            print("\n".join(lines), flush=True)

    report(header(collective, args, hostnames) + table.header_lines())
    rows_by_size = []
    for count in counts_to_measure(collective, args):
        rows = measure_size(count, collective, args, pattern, bootstrap, synchronize,
                            one_host=one_host)
        rows_by_size.append(rows)
        report([table.row_line(rows)])
    report(summary(rows_by_size, args))
    if args.alloc == "backend":
        from .. import shared_memory_stats

        arena = shared_memory_stats()
        if arena["live_bytes"] or arena["free_bytes"] or arena["released_segments"]:  # torus allocated
            report([shared_memory_line(arena)])

    if rank == 0 and args.json:
        write_json(args.json, collective, args, hostnames, rows_by_size)
        print(f"# wrote {args.json}", flush=True)
    if rank == 0 and args.plot:
        write_plot(args.plot, collective, args, rows_by_size)
        print(f"# wrote {args.plot}", flush=True)
    dist.destroy_process_group()
