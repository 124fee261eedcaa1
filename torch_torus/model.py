"""Predict allreduce time and DDP images/s per node for a described cluster, 16 to 4096 nodes.

    python -m torch_torus.model --preset nurion --plot nurion_model.png
    python -m torch_torus.model --preset nurion --link-latency 2us --blocking 0
    python -m torch_torus.model --fit benchmarks/results/tuning_4ranks.json   # this machine

The cluster: `nodes` hosts of `ranks_per_node` ranks, each host with one network link
(bandwidth, latency per step), hosts in leaf switches of `nodes_per_switch` whose uplinks carry
(1 - blocking) of what their hosts can send (a fat tree with 50% blocking: blocking=0.5). Ranks
on one host talk at the local bandwidth and latency. Ranks are placed in order (host h holds
ranks h*ranks_per_node ...), the torus as rows of consecutive ranks, as torch_torus.topology does.

The algorithms are torch_torus.cost_model's: the collective calls each makes, each a sequence of
steps saying how much every rank sends, reduces and to whom (the one description the group's
automatic choice uses too). What this module adds is the cluster. Each step runs on the machine
the cluster is for it: its latency is the link's where a message crosses hosts, the local one
elsewhere, and its bytes flow at the pace of the most loaded path they share: a rank's copies to
ranks of its own host (local bandwidth), the busiest host link (its bandwidth shared by the
host's bytes that leave it), the busiest leaf's uplinks. So

    time = max(call_floor, calls x call_overhead + sum over steps of (latency
               + bytes / step bandwidth + bytes reduced / reduce_rate
               + extra concurrent messages x message_overhead))

where the torus pays three call overheads (row reduce-scatter, column allreduce, row allgather)
under one floor. call_floor is the least an allreduce takes whatever its steps: where ranks
outnumber cores, every rank must get a core before it can end, which costs the same for one step
as for six (on this machine 4 ranks took 0.2-0.3 ms at 4 KiB with any algorithm); once they run,
the torus's later calls do not pay it again. Elsewhere it is 0. On one host, with no call
overhead and no floor, this is cost_model.allreduce_seconds with the local figures as its
machine, except two_shot: its bytes are single copies between the ranks' buffers, charged half a
message's two copies here, where the selection model's fitted shared-memory figures count them
whole.

A DDP step (ResNet-50's 25.6M float32 gradients in buckets of bucket_bytes): the allreduces
run one after another while backward (backward_share of the compute time) produces buckets, so

    step = compute + max(last bucket's allreduce, all allreduces - backward time)
    images/s per node = batch_per_node / step

--fit adjusts the latency, bandwidth, reduce-rate, overhead and floor figures to bench --json or tuning
files (least squares of the relative errors, over the figures' logarithms, by scipy.optimize)
and prints each measurement beside its prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass

from . import algorithms, cost_model, units
from .algorithms import GRID_ALLREDUCE, NEEDS_GRID, SHARED_MEMORY

# The allreduce algorithms the model compares across nodes (the shared-memory ones run on one host only).
ALGORITHMS = tuple(a for a in algorithms.ALLREDUCE if a not in SHARED_MEMORY)
MODELLED = algorithms.ALLREDUCE


@dataclass(frozen=True)
class System:
    nodes: int = 1
    ranks_per_node: int = 1
    link_bandwidth: float = 12.5e9  # bytes/s one host sends into the network
    link_latency: float = 4e-6  # seconds per step between hosts, software included
    local_bandwidth: float = 10e9  # bytes/s between two ranks of one host
    local_latency: float = 1e-6
    nodes_per_switch: int = 32
    blocking: float = 0.0  # share of a leaf's host bandwidth its uplinks lack (0.5: 50% blocking)
    reduce_rate: float = 5e9  # bytes/s one rank reduces
    message_overhead: float = 0.0  # seconds per extra concurrent message within a step
    call_overhead: float = 0.0  # seconds per collective call (the torus makes three)
    call_floor: float = 0.0  # the least an allreduce takes: every rank scheduled, where ranks outnumber cores
    # DDP
    compute_seconds: float = 1.0  # forward + backward + optimizer of one step, no communication
    backward_share: float = 0.6  # of compute_seconds, overlappable with the allreduces
    gradient_bytes: int = 25_557_032 * 4  # ResNet-50, float32
    bucket_bytes: int = 25 << 20  # DDP's bucket_cap_mb default
    batch_per_node: int = 8

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    def validate(self) -> "System":
        problems = [f"{name} must be at least 1" for name in ("nodes", "ranks_per_node", "nodes_per_switch",
                                                             "batch_per_node")
                    if getattr(self, name) < 1]
        problems += [f"{name} must be greater than 0" for name in
                     ("link_bandwidth", "local_bandwidth", "reduce_rate", "gradient_bytes", "bucket_bytes")
                     if not getattr(self, name) > 0]
        problems += [f"{name} must not be negative" for name in
                     ("link_latency", "local_latency", "message_overhead", "call_overhead", "call_floor",
                      "compute_seconds")
                     if getattr(self, name) < 0]
        if not 0 <= self.blocking < 1:
            problems.append("blocking must lie in [0, 1): at 1 no traffic would leave a switch")
        if not 0 <= self.backward_share <= 1:
            problems.append("backward_share must lie in [0, 1]")
        if problems:
            raise ValueError("; ".join(problems))
        return self


# Nurion (KISTI): KNL nodes, Omni-Path fat tree with 50% blocking, one rank per node, batch 8 per
# node, ResNet-50. The link is Omni-Path's 100 Gb/s; the latency per step, the per-call overhead
# (the torus pays it three times) and the per-message overhead of direct are the software's on
# KNL cores, which the study does not report: they were chosen within plausible ranges so the
# model orders the algorithms as the study measured (BENCHMARKS.md shows how sensitive that is).
# The compute time is that of a KNL node on ResNet-50, batch 8 (about 20 images/s).
NURION = System(
    nodes=16, ranks_per_node=1, link_bandwidth=12.5e9, link_latency=4e-6, local_bandwidth=20e9,
    local_latency=1e-6, nodes_per_switch=64, blocking=0.5, reduce_rate=4e9, message_overhead=0.3e-6,
    call_overhead=1.2e-3, compute_seconds=0.4, backward_share=0.6, batch_per_node=8)


# --------------------------------------------------------------------------------------------
# The selection model's steps, each given the latency and bandwidth the system gives it


@dataclass(frozen=True)
class _Path:
    """Where a rank's bytes go in one of a step's repeats, per byte it sends."""

    crosses_hosts: bool
    within: float  # the most that goes to ranks of the sender's own host
    host: float  # over the busiest host link
    leaf: float  # over the busiest leaf switch's uplinks


def _path(step: cost_model.Step, hosts: list[int], leaves: list[int]) -> _Path:
    """`hosts[r]`, `leaves[r]`: rank r's host and leaf switch."""
    if not step.flows:  # shared memory: every byte stays on the host
        return _Path(False, 1.0, 0.0, 0.0)
    on_hosts, on_leaves = cost_model.crossing(step, hosts), cost_model.crossing(step, leaves)
    return _Path(bool(on_hosts.out), on_hosts.within / step.sent, on_hosts.busiest / step.sent,
                 on_leaves.busiest / step.sent)


@functools.lru_cache(maxsize=1024)
def _calls(algorithm: str, n: int, shape: tuple[int, int] | None, ranks_per_node: int,
           nodes_per_switch: int) -> tuple[tuple[tuple[cost_model.Step, _Path], ...], ...]:
    """The collective calls of an allreduce over n ranks placed in order, host h holding ranks
    h*ranks_per_node..., each as its steps and their paths."""
    calls = cost_model.allreduce_calls(algorithm, tuple(range(n)), cost_model.row_major(shape))
    hosts = [r // ranks_per_node for r in range(n)]
    leaves = [r // (ranks_per_node * nodes_per_switch) for r in range(n)]
    return tuple(tuple((step, _path(step, hosts, leaves)) for step in call) for call in calls)


def _step_seconds(system: System, step: cost_model.Step, path: _Path, nbytes: float) -> float:
    """The step on the machine that the system is for it: its latency is the link's where a
    message crosses hosts, and its bytes flow at the pace of the slowest path they share: copies
    on the host, the host's link (shared by the host's flows that leave it), the leaf's uplinks
    (which carry 1 - blocking of what the leaf's hosts can send)."""
    uplinks = (1 - system.blocking) * system.nodes_per_switch * system.link_bandwidth
    seconds_per_byte = max(path.within / system.local_bandwidth, path.host / system.link_bandwidth,
                           path.leaf / uplinks)
    if step.single_copy:  # one copy where a message makes two
        seconds_per_byte /= 2
    machine = cost_model.Machine(latency=system.link_latency if path.crosses_hosts else system.local_latency,
                                 bandwidth=1 / seconds_per_byte, reduce_rate=system.reduce_rate,
                                 message_overhead=system.message_overhead)
    return machine.seconds(cost_model.step_terms(step, nbytes))


def torus_shapes(n: int) -> list[tuple[int, int]]:
    """Every rows x columns grid of n ranks with at least two of each."""
    return [(n // c, c) for c in range(2, n // 2 + 1) if n % c == 0]


def default_shape(n: int) -> tuple[int, int] | None:
    """The grid torch_torus.topology picks on one host: the most square, fewer rows."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return (rows, n // rows) if rows > 1 else None


def allreduce_seconds(system: System, algorithm: str, nbytes: float,
                      shape: tuple[int, int] | None = None) -> float:
    """One allreduce of `nbytes` over the system's ranks. `shape` (rows, columns) sets the
    torus grid; without one the torus takes its best grid, or runs as the ring if it has none."""
    n = system.ranks
    if n > 1 and algorithm in NEEDS_GRID and shape is None:
        shapes = torus_shapes(n)
        if not shapes:
            return allreduce_seconds(system, algorithms.instead("allreduce", algorithm, "grid"), nbytes)
        return min(allreduce_seconds(system, algorithm, nbytes, s) for s in shapes)
    if algorithm not in MODELLED:
        raise ValueError(f"no model for allreduce algorithm {algorithm!r}; known: {', '.join(MODELLED)}")
    if algorithm in SHARED_MEMORY and system.nodes > 1:
        raise ValueError(f"{algorithm} needs every rank on one host (shared memory); "
                         f"this system has {system.nodes} nodes")
    shape = shape if algorithm in NEEDS_GRID else None
    if shape is not None and shape[0] * shape[1] != n:
        raise ValueError(f"torus shape {shape[0]}x{shape[1]} does not hold {n} ranks")
    calls = _calls(algorithm, n, shape, system.ranks_per_node, system.nodes_per_switch)
    seconds = sum(system.call_overhead + sum(_step_seconds(system, step, path, nbytes) for step, path in call)
                  for call in calls)
    # One rank has no steps, but its allreduce is still a call.
    return max(system.call_floor, seconds if calls else system.call_overhead)


# Grids predicted within this fraction of each other are tied. A grid and its transpose move the
# same bytes in the same steps wherever the uplinks do not tell them apart, and which of the two
# sums comes out a rounding error faster depends on the order of its terms.
_SHAPE_TIE = 1e-12


def best_torus_shape(system: System, nbytes: float) -> tuple[int, int] | None:
    """The fastest grid; of tied ones, the first of torus_shapes (the most rows)."""
    seconds = {s: allreduce_seconds(system, GRID_ALLREDUCE, nbytes, s) for s in torus_shapes(system.ranks)}
    if not seconds:
        return None
    fastest = min(seconds.values())
    return next(s for s, t in seconds.items() if t <= fastest * (1 + _SHAPE_TIE))


def bucket_sizes(system: System) -> list[int]:
    full, rest = divmod(system.gradient_bytes, system.bucket_bytes)
    return [system.bucket_bytes] * full + ([rest] if rest else [])


def ddp_step_seconds(system: System, algorithm: str, shape: tuple[int, int] | None = None) -> float:
    buckets = [allreduce_seconds(system, algorithm, b, shape) for b in bucket_sizes(system)]
    exposed = max(buckets[-1], sum(buckets) - system.backward_share * system.compute_seconds)
    return system.compute_seconds + exposed


def images_per_second_per_node(system: System, algorithm: str, shape: tuple[int, int] | None = None) -> float:
    return system.batch_per_node / ddp_step_seconds(system, algorithm, shape)


# --------------------------------------------------------------------------------------------
# Fitting to measurements


FITTED = ("link_latency", "link_bandwidth", "local_latency", "local_bandwidth", "reduce_rate",
          "message_overhead", "call_overhead", "call_floor")


@dataclass(frozen=True)
class Measurement:
    nodes: int
    ranks_per_node: int
    algorithm: str
    nbytes: int
    seconds: float
    shape: tuple[int, int] | None



def load_measurements(paths: list[str]) -> list[Measurement]:
    """Single-algorithm rows of bench --json files and tuning files (python -m torch_torus.tune).
    Hosts must hold equal numbers of ranks; the torus takes the grid topology would choose."""
    found = []
    for path in paths:
        with open(path) as file:
            document = json.load(file)
        if "entries" in document:  # a tuning file
            for entry in document["entries"]:
                per_host = entry["ranks_per_host"]
                shape = tuple(entry["grid"]) if entry["grid"] else None
                for algorithm, times in entry["measured"]["time_us"].items():
                    if algorithm not in MODELLED:
                        continue
                    for nbytes, us in zip(entry["measured"]["sizes"], times):
                        if us is None:  # the algorithm does not run at that size
                            continue
                        found.append(Measurement(len(per_host), per_host[0], algorithm, nbytes, us * 1e-6, shape))
        else:  # bench --json
            per_host = list(document["hosts"].values())
            n = document["world_size"]
            shape = (len(per_host), per_host[0]) if len(per_host) > 1 and per_host[0] > 1 else default_shape(n)
            for row in document["rows"]:
                # A fixed contender's row, as the algorithm that ran (one_shot's group runs
                # two_shot above its shared-memory slot).
                fixed = row.get("options", {}).get("allreduce")
                algorithm = row.get("algorithm") or fixed
                if row["backend"] == "torus" and fixed in MODELLED and algorithm in MODELLED and row["time_us"]:
                    found.append(Measurement(len(per_host), per_host[0], algorithm, row["size_bytes"],
                                             row["time_us"] * 1e-6, shape))
    return found


def predict(system: System, m: Measurement) -> float:
    placed = dataclasses.replace(system, nodes=m.nodes, ranks_per_node=m.ranks_per_node)
    return allreduce_seconds(placed, m.algorithm, m.nbytes, m.shape if m.algorithm in NEEDS_GRID else None)


def fit(system: System, measurements: list[Measurement], fixed: tuple[str, ...] = ()) -> System:
    """The system with FITTED figures adjusted to minimise the squared relative error of the
    predictions, by scipy.optimize.least_squares over the figures' logarithms (they stay
    positive and move by factors; the model is piecewise in them, so the Jacobian is taken by
    differences of 0.1%). Figures that no measurement depends on (the link's, when every
    measurement is on one host) keep their values, and so do those named in `fixed` (known
    ones, such as a link's measured rate)."""
    from scipy.optimize import least_squares

    def errors(candidate: System) -> list[float]:
        return [predict(candidate, m) / m.seconds - 1 for m in measurements]

    # Zero overheads cannot be scaled: start them small but not zero. A floor below every
    # prediction changes nothing, so the fit would never move it: start it at half the fastest
    # call measured. Figures given stay as given, zero included (--call-floor 0: no floor).
    starts = {"message_overhead": system.message_overhead or 1e-6, "call_overhead": system.call_overhead or 1e-6,
              "call_floor": system.call_floor or min(m.seconds for m in measurements) / 2}
    start = dataclasses.replace(system, **{name: value for name, value in starts.items() if name not in fixed})
    at_start = errors(start)
    free = [name for name in FITTED if name not in fixed and any(
        errors(dataclasses.replace(start, **{name: getattr(start, name) * scale})) != at_start for scale in (4, 1 / 4))]
    if not free:
        return start

    def with_logs(logs) -> System:
        return dataclasses.replace(start, **{name: math.exp(value) for name, value in zip(free, logs)})

    solution = least_squares(lambda logs: errors(with_logs(logs)), [math.log(getattr(start, n)) for n in free],
                             diff_step=1e-3)
    return with_logs(solution.x)


# --------------------------------------------------------------------------------------------
# Command line


# Command-line figures in torch_torus.units' convention; a number without a unit is in bytes
# per second (rates) or seconds (durations).
_rate = units.argument(functools.partial(units.parse_rate, default_unit="B/s"))
_seconds = units.argument(functools.partial(units.parse_duration, default_unit="s"))
_size = units.argument(units.parse_size)

_OPTIONS = {  # System field -> (parser, help)
    "ranks_per_node": (int, "ranks per node"),
    "link_bandwidth": (_rate, "rate of a node's network link: bytes/s (12.5G, 12.5GB/s) or bits (100gbit)"),
    "link_latency": (_seconds, "latency of one step between nodes, e.g. 4us"),
    "local_bandwidth": (_rate, "bytes/s between ranks of one node"),
    "local_latency": (_seconds, "latency of one step within a node"),
    "nodes_per_switch": (int, "nodes per leaf switch"),
    "blocking": (float, "fat-tree blocking: share of a leaf's bandwidth its uplinks lack (0.5 = 50%%)"),
    "reduce_rate": (_rate, "bytes/s one rank reduces"),
    "message_overhead": (_seconds, "per extra concurrent message (direct)"),
    "call_overhead": (_seconds, "per collective call (the torus makes three)"),
    "call_floor": (_seconds, "the least an allreduce takes (ranks outnumbering cores); 0 elsewhere"),
    "compute_seconds": (_seconds, "compute time of one training step"),
    "backward_share": (float, "share of the compute that overlaps the allreduces"),
    "gradient_bytes": (_size, "gradient bytes per step, e.g. 100M"),
    "bucket_bytes": (_size, "DDP bucket size, e.g. 25M"),
    "batch_per_node": (int, "images per node per step"),
}
PRESETS = {"nurion": NURION, "default": System()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torch_torus.model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="nurion",
                        help="starting figures (default: %(default)s); options below override them")
    for name, (parse, help_text) in _OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=parse, help=help_text)
    parser.add_argument("--nodes", default="16-4096",
                        help="node counts: 'LO-HI' for the powers of two between, or a comma list (default: %(default)s)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma list (default: all)")
    parser.add_argument("--shapes-at", type=int, metavar="NODES",
                        help="also print the DDP images/s of every torus grid at this node count")
    parser.add_argument("--fit", nargs="+", metavar="JSON",
                        help="fit the figures to bench --json or tuning files first, and print the comparison")
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="print predictions beside the measurements of these files (after --fit, if given)")
    parser.add_argument("--plot", metavar="PNG", help="draw allreduce time and images/s per node against nodes")
    return parser


def node_counts(text: str) -> list[int]:
    text = text.strip()
    match = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    if match:
        lo, hi = int(match.group(1)), int(match.group(2))
        counts = [1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi]
    elif re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        counts = [int(part) for part in text.split(",")]
    else:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--nodes {text!r}: expected LO-HI (powers of two between) or a comma list of counts >= 1")
    return counts


def table(system: System, counts: list[int], algorithms: list[str]) -> list[str]:
    buckets = bucket_sizes(system)
    lines = [f"# {system}",
             f"# per step: {len(buckets)} allreduces ({', '.join(f'{b / 2**20:.1f} MiB' for b in buckets)}); "
             f"ms = their total; img/s = per node",
             f"{'nodes':>6} " + " ".join(f"{a:>22}" for a in algorithms) + "  best (torus grid)",
             f"{'':>6} " + " ".join(f"{'ms':>10} {'img/s':>11}" for _ in algorithms)]
    for nodes in counts:
        placed = dataclasses.replace(system, nodes=nodes)
        rates = {a: images_per_second_per_node(placed, a) for a in algorithms}
        cells = [f"{sum(allreduce_seconds(placed, a, b) for b in buckets) * 1e3:>10.2f} {rates[a]:>11.3f}"
                 for a in algorithms]
        best = max(algorithms, key=rates.get)
        shape = best_torus_shape(placed, system.bucket_bytes)
        lines.append(f"{nodes:>6} " + " ".join(cells) + f"  {best}" + (f" ({shape[0]}x{shape[1]})" if shape else ""))
    return lines


def shapes_table(system: System, nodes: int) -> list[str]:
    placed = dataclasses.replace(system, nodes=nodes)
    lines = [f"# torus grids at {nodes} nodes: images/s per node (allreduce ms per step)"]
    for shape in torus_shapes(placed.ranks):
        total = sum(allreduce_seconds(placed, GRID_ALLREDUCE, b, shape) for b in bucket_sizes(placed))
        lines.append(f"  {shape[0]:>5}x{shape[1]:<5} {images_per_second_per_node(placed, GRID_ALLREDUCE, shape):9.3f} "
                     f"({total * 1e3:.2f})")
    return lines


def plot(system: System, counts: list[int], algorithms: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axes, rate_axes) = plt.subplots(1, 2, figsize=(12, 5))
    for algorithm in algorithms:
        placed = [dataclasses.replace(system, nodes=n) for n in counts]
        time_axes.plot(counts, [sum(allreduce_seconds(s, algorithm, b) for b in bucket_sizes(s)) * 1e3 for s in placed],
                       marker="o", label=algorithm)
        rate_axes.plot(counts, [images_per_second_per_node(s, algorithm) for s in placed], marker="o", label=algorithm)
    for axes in (time_axes, rate_axes):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("nodes")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    time_axes.set_yscale("log")
    time_axes.set_ylabel("allreduce time per step (ms)")
    rate_axes.set_ylabel("images/s per node")
    figure.suptitle(f"model: {system.ranks_per_node} rank(s)/node, link {system.link_bandwidth / 1e9:g} GB/s, "
                    f"{system.link_latency * 1e6:g} us, blocking {system.blocking:g}, compute {system.compute_seconds:g} s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def comparison(system: System, measurements: list[Measurement]) -> list[str]:
    lines = [f"# {'nodes':>5} {'r/node':>6} {'algorithm':>18} {'bytes':>10} {'measured us':>12} "
             f"{'predicted us':>12} {'ratio':>6}"]
    for m in measurements:
        predicted = predict(system, m)
        lines.append(f"  {m.nodes:>5} {m.ranks_per_node:>6} {m.algorithm:>18} {m.nbytes:>10} {m.seconds * 1e6:>12.1f} "
                     f"{predicted * 1e6:>12.1f} {predicted / m.seconds:>6.2f}")
    within = sum(abs(predict(system, m) / m.seconds - 1) <= 0.25 for m in measurements)
    lines.append(f"# within 25%: {within} of {len(measurements)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {name: getattr(args, name) for name in _OPTIONS if getattr(args, name) is not None}
    try:
        system = dataclasses.replace(PRESETS[args.preset], **overrides).validate()
        counts = node_counts(args.nodes)
    except ValueError as error:
        parser.error(str(error))
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"--algorithms: unknown {', '.join(unknown)}; known: {', '.join(ALGORITHMS)}")
    if args.fit:
        measurements = load_measurements(args.fit)
        if not measurements:
            parser.error("--fit: no single-algorithm torus measurements in " + ", ".join(args.fit))
        # Figures given on the command line are known: the fit leaves them as they are.
        system = fit(system, measurements, fixed=tuple(n for n in FITTED if n in overrides))
        print(f"# fitted to {len(measurements)} measurements in {', '.join(args.fit)}: "
              + ", ".join(f"{n}={getattr(system, n):.4g}" + (" (given)" if n in overrides else "") for n in FITTED))
        print("\n".join(comparison(system, measurements)))
    if args.compare:
        measurements = load_measurements(args.compare)
        if not measurements:
            parser.error("--compare: no single-algorithm torus measurements in " + ", ".join(args.compare))
        print(f"# predictions against {', '.join(args.compare)}")
        print("\n".join(comparison(system, measurements)))
    print("\n".join(table(system, counts, algorithms)))
    if args.shapes_at:
        print("\n".join(shapes_table(system, args.shapes_at)))
    if args.plot:
        plot(system, counts, algorithms, args.plot)
        print(f"# wrote {args.plot}")


if __name__ == "__main__":
    main()
