"""The report, on rank 0: nccl-tests' table (a group of columns per contender), the summary with
busbw ratios against a baseline, and the optional JSON file and PNG plot."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import torch

from .collectives import Collective
from .contenders import Contender
from .measure import Row
from .memory_bound import HostMemory
from .sizes import human_size
from .timing import TIMINGS, DeviceCopy

# --------------------------------------------------------------------------------------------
# Report (rank 0)


class Table:
    """nccl-tests layout: common columns, then one group of columns per contender."""

    COMMON = "{:>12}  {:>12}  {:>8}  {:>6}  {:>5}"
    TIME = "  {:>10}"
    # with --timing osu: OSU's Avg, Min and Max Latency, the barrier's exit skew and the call after
    # the last rank's start
    LATENCY = "  {:>9}  {:>9}  {:>9}  {:>7}  {:>7}"
    BANDWIDTH = "  {:>7}  {:>7}  {:>6}"  # algbw, busbw, #wrong
    COPY_SHARE = "  {:>6}"  # with --device cuda: busbw as a percentage of the GPU's copy bandwidth
    MEMORY_SHARE = "  {:>5}"  # on one CPU host: the memory's bound as a percentage of the time
    ALGORITHM = "  {:>18}"

    def __init__(self, collective: Collective, args: argparse.Namespace):
        self.collective, self.contenders, self.args = collective, args.contenders, args
        self.copy: DeviceCopy | None = getattr(args, "device_copy", None)
        self.memory: HostMemory | None = getattr(args, "host_memory", None)
        self.latency = args.timing == "osu"

    def group_format(self, contender: Contender) -> str:
        return (self.TIME + (self.LATENCY if self.latency else "") + self.BANDWIDTH
                + (self.COPY_SHARE if self.copy else "") + (self.MEMORY_SHARE if self.memory else "")
                + (self.ALGORITHM if contender.algorithm_for else ""))

    def header_lines(self) -> list[str]:
        common_width = len(self.COMMON.format(*[""] * 5))
        titles = " " * common_width
        names = self.COMMON.format("size", "count", "type", "redop", "root")
        units = self.COMMON.format("(B)", "(elements)", "", "", "")
        for index, contender in enumerate(self.contenders, 1):
            group = self.group_format(contender)
            width = len(group.format(*[""] * group.count("{")))
            title = f"[{index}] {contender.label}"
            if len(title) > width - 2:
                title = title[:width - 5] + "..."
            titles += "  " + title.ljust(width - 2)
            latency = ("avg lat", "min lat", "max lat", "skew", "in all") if self.latency else ()
            share = ("%copy",) * bool(self.copy) + ("%mem",) * bool(self.memory)
            extra = ("algorithm",) if contender.algorithm_for else ()
            names += group.format("time", *latency, "algbw", "busbw", "#wrong", *share, *extra)
            units += group.format("(us)", *("(us)",) * len(latency), "(GB/s)", "(GB/s)", "",
                                  *("(%)",) * len(share), *("",) * len(extra))
        return ["#" + line[1:].rstrip() for line in (titles, names, units)]

    def row_line(self, rows: list[Row]) -> str:
        collective, first = self.collective, rows[0]
        line = self.COMMON.format(
            first.size_bytes, first.count, self.args.dtype,
            self.args.op if collective.has_op else "none",
            collective.root if collective.has_root else -1)
        for row in rows:
            values = [f"{row.time_us:.1f}"]
            if self.latency:
                values += [f"{row.latency_avg_us:.1f}", f"{row.latency_min_us:.1f}", f"{row.latency_max_us:.1f}",
                           *(("-", "-") if row.exit_skew_us is None else
                             (f"{row.exit_skew_us:.1f}", f"{row.after_last_us:.1f}"))]
            values += [f"{row.algbw:.3f}", f"{row.busbw:.3f}", "-" if row.wrong is None else str(row.wrong)]
            if self.copy:
                values.append("-" if row.copy_share is None else f"{100 * row.copy_share:.2f}")
            if self.memory:
                values.append("-" if row.memory_share is None else f"{100 * row.memory_share:.0f}")
            if row.contender.algorithm_for:
                values.append(row.algorithm)
            line += self.group_format(row.contender).format(*values)
        return line


def describe_hosts(hostnames: list[str]) -> str:
    ranks_per_host = Counter(hostnames)
    shown = ", ".join(f"{host} ({ranks})" for host, ranks in list(ranks_per_host.items())[:8])
    more = f", ... {len(ranks_per_host) - 8} more" if len(ranks_per_host) > 8 else ""
    plural = "s" if len(ranks_per_host) > 1 else ""
    return f"{len(hostnames)} ranks on {len(ranks_per_host)} host{plural}: {shown}{more}"


def timing_lines(collective: Collective, args: argparse.Namespace) -> list[str]:
    """How calls were timed (--timing, rounds) and what the time columns mean."""
    osu = args.timing == "osu"
    rounds = ""
    if args.rounds > 1:
        counted = "the median over all rounds' calls counts" if osu else "the best round counts"
        rounds = f"; {args.rounds} rounds of every contender in turn, {counted}" + (
            f"; after the first round, as many calls as last {args.min_round_ms:g} ms" if args.min_round_ms > 0 else "")
    time = ("median over calls of the slowest rank's time of the call; avg/min/max lat = each rank's mean "
            "per call, averaged/least/most over ranks (OSU's Avg/Min/Max Latency); skew = the last rank's "
            "start less the first's, in all = the last rank's start to the last rank's end (medians over "
            "calls; - where ranks are on several hosts)"
            if osu else "mean per call, slowest rank")
    return [
        f"# timing {args.timing}: {args.iters} timed calls after {args.warmup} warmup calls per size and contender, "
        f"{TIMINGS[args.timing]}{rounds}",
        f"# time = {time}; algbw = size / time; "
        f"busbw = algbw * {collective.bus_factor_doc} (n = {collective.world_size}); #wrong = "
        + ("elements that differ from the reference" if args.check else "- (results not checked: pass --check)"),
    ]


def header(collective: Collective, args: argparse.Namespace, hostnames: list[str]) -> list[str]:
    op = args.op if collective.has_op else "none"
    lines = [
        f"# torch_torus.bench: {collective.name}, {args.dtype}, redop {op}, device {args.device}",
        f"# {describe_hosts(hostnames)}",
        *timing_lines(collective, args),
        "# buffers: " + ("torch.empty" if args.alloc == "torch" else
                         "allocate_tensor of the first contender's group that has it, shared by every contender"),
        f"# torch {torch.__version__}" + (
            f", torch_torus {sys.modules['torch_torus'].__version__}" if "torch_torus" in sys.modules else ""),
    ]
    copy: DeviceCopy | None = getattr(args, "device_copy", None)
    if copy is not None:
        lines.append(
            f"# device-to-device copy on rank 0's GPU, {copy.device}: {copy.gbps:.1f} GB/s, bytes read + "
            f"written per second by a torch copy_ of {human_size(copy.nbytes)}iB, timed with CUDA events, best "
            f"of {copy.rounds} rounds of {copy.copies}; %copy = busbw as a percentage of it")
    memory: HostMemory | None = getattr(args, "host_memory", None)
    if memory is not None:
        lines.append(f"# host memory: {memory.describe()}")
        lines.append(f"# %mem = the memory's bound as a percentage of the time: {collective.name} reads and writes "
                     f"at least {collective.memory_bytes_doc} bytes (each input read once, each output written "
                     f"once), which take {collective.memory_bytes_doc} / {memory.gbps:.1f} GB/s")
    lines.append("# contenders:")
    for index, contender in enumerate(args.contenders, 1):
        if contender.library:
            lines.append(f"#   [{index}] {contender.backend:<8} {contender.library}")
            continue
        options = " ".join(f"{key}={value}" for key, value in contender.options.items())
        over = f", over {contender.transport}" if contender.transport else ""
        lines.append(f"#   [{index}] {contender.backend:<8} options: {options or '(backend defaults)'}{over}")
    return lines + ["#"]


def baseline_index(contenders: list[Contender]) -> int:
    """Ratios are taken against gloo, the backend torch ships for CPU, else the first contender."""
    for index, contender in enumerate(contenders):
        if contender.label == "gloo":
            return index
    return 0


def summary(rows_by_size: list[list[Row]], args: argparse.Namespace) -> list[str]:
    contenders = args.contenders
    lines = ["#"]
    if args.check:
        wrong = sum(row.wrong for rows in rows_by_size for row in rows)
        lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    averages = [sum(rows[index].busbw for rows in rows_by_size) / len(rows_by_size)
                for index in range(len(contenders))]
    lines.append("# Avg bus bandwidth (GB/s): " + "  ".join(
        f"[{index}] {average:.3f}" for index, average in enumerate(averages, 1)))
    copy: DeviceCopy | None = getattr(args, "device_copy", None)
    if copy is not None:
        lines.append(f"# Avg bus bandwidth as % of the device copy ({copy.gbps:.1f} GB/s): " + "  ".join(
            f"[{index}] {100 * average / copy.gbps:.2f}" for index, average in enumerate(averages, 1)))
    if len(contenders) < 2:
        return lines
    base = baseline_index(contenders)
    others = [index for index in range(len(contenders)) if index != base]
    lines += ["#", f"# busbw relative to [{base + 1}] {contenders[base].label} (above 1: faster)",
              "#" + "{:>11}".format("size") + "".join(f"  {f'[{index + 1}]':>8}" for index in others)]

    def ratio(value: float, reference: float) -> str:
        return f"{value / reference:8.2f}" if reference > 0 else f"{'-':>8}"

    for rows in rows_by_size:
        lines.append(f"{rows[0].size_bytes:>12}" + "".join(
            "  " + ratio(rows[index].busbw, rows[base].busbw) for index in others))
    lines.append("#" + "{:>11}".format("avg busbw") + "".join(
        "  " + ratio(averages[index], averages[base]) for index in others))
    return lines


def write_json(path: str, collective: Collective, args: argparse.Namespace, hostnames: list[str],
               rows_by_size: list[list[Row]]) -> None:
    document = {
        "collective": collective.name,
        "dtype": args.dtype,
        "op": args.op if collective.has_op else None,
        "root": collective.root if collective.has_root else None,
        "device": args.device,
        "world_size": collective.world_size,
        "hosts": dict(Counter(hostnames)),
        "iters": args.iters,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "min_round_ms": args.min_round_ms,
        "timing": args.timing,
        "alloc": args.alloc,
        "torch_version": torch.__version__,
        "contenders": [{"label": c.label, "backend": c.backend, "options": c.options,
                        "library": c.library} for c in args.contenders],
        "rows": [row.to_json() for rows in rows_by_size for row in rows],
    }
    copy: DeviceCopy | None = getattr(args, "device_copy", None)
    if copy is not None:  # the rows' busbw_share_of_device_copy are shares of this
        document["device_copy"] = {"gbps": copy.gbps, "bytes": copy.nbytes, "device": copy.device,
                                   "rounds": copy.rounds, "copies_per_round": copy.copies,
                                   "measured_on": "rank 0"}
    memory: HostMemory | None = getattr(args, "host_memory", None)
    if memory is not None:  # the rows' share_of_memory_bound are shares of its bound
        document["host_memory_bandwidth"] = memory.to_json()
    with open(path, "w") as file:
        json.dump(document, file, indent=1)



def write_plot(path: str, collective: Collective, args: argparse.Namespace,
               rows_by_size: list[list[Row]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    figure, axes = plt.subplots(figsize=(8, 5))
    sizes = [rows[0].size_bytes for rows in rows_by_size]
    for index, contender in enumerate(args.contenders):
        axes.plot(sizes, [rows[index].busbw for rows in rows_by_size], marker="o",
                  label=contender.legend)
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(FuncFormatter(lambda size, _: human_size(size)))
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(f"{collective.name} {args.dtype}, {collective.world_size} ranks")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
