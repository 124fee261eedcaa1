"""How long each AllReduce algorithm takes, from three machine figures (NCCL-style tuning).

    time = steps x latency + bytes on the wire / bandwidth + bytes reduced / reduce_rate

for n ranks and S bytes (p: the largest power of two <= n; the torus: r rows of c ranks):

    ring                2(n-1) steps, 2S(n-1)/n sent, S(n-1)/n reduced
    direct              2 steps of n-1 concurrent messages each, 2S(n-1)/n sent
    recursive_doubling  log2 p steps of S, plus a fold and an unfold of S when n != p
    rabenseifner        2 log2 p steps, 2S(p-1)/p sent, plus the fold and unfold when n != p
    torus               a ring reduce-scatter and allgather along the rows, the inner
                        algorithm on S // c along the columns
    one_shot            1 step; S copied into shared memory, (n-1)S reduced (shm only)
    two_shot            2 steps; 2S(n-1)/n copied between processes, S(n-1)/n reduced, no
                        messages (shm only)

On one host whose C cores n > C ranks share (shared memory), every step costs
crowded_latency x (n/C - 1) more (`Machine.on_host`): it waits for peers that must first get a
core. One latency cannot place the one_shot/two_shot crossover at 2, 4 and 8 ranks on 2 cores
alike (measured near 64 KiB, 256 KiB and 256 KiB); with this term the fit does (BENCHMARKS.md,
issue 18).

Each algorithm is described once, as the collective calls it makes, each a list of steps
(`allreduce_calls`): how often a step repeats, what one rank sends and reduces in it, in how many
concurrent messages, and which ranks send how much to which (`Flows`). The per-rank terms above,
the bytes over each host's link below and the cluster predictor (torch_torus.model) are all read
from that description.

The machine figures, one set per transport, were measured on the development machine
(BENCHMARKS.md).

Across hosts, the ranks of a host share its network link. For a group whose ranks live on
several hosts the time is the larger of the per-rank time above (CPU, memory, the TCP stack)
and the time of the busiest host link:

    link time = bytes crossing the busiest host's link in one direction / link bandwidth
                + dependent steps in which some message crosses hosts x link latency

The bytes come from each algorithm's communication pattern over the group's actual rank
placement (`host_pattern`), e.g. for H hosts of P consecutive ranks (n = HP a power of two for
the last two), S bytes, per link each way:

    ring                2S(n-1)/n                 (one ring edge leaves each host)
    torus, host rows    2S(H-1)/H                 (only the column phase crosses)
    direct              2S P(n-P)/n               (each rank's blocks for the other hosts)
    recursive_doubling  S P log2 H                (the rounds at distances >= P cross)
    rabenseifner        2S P(n-P)/n               (the same rounds, S d/n each at distance d)

Where an algorithm runs in phases one after another, the phases add up: recursive doubling's
and Rabenseifner's rounds (`host_rounds`), each the longer of its own transfer over the link and
the ranks' own time; the torus's row and column phases overlap only across its segments
(torus_allreduce.cc), so a torus of one segment takes its row phases plus its column phase.
Where the predictions come within LINK_TIE of each other, the fewest bytes over the link win,
then the ring (`best_allreduce`). The link's figures are a
machine description of their own ("tcp across hosts", `HOST_LINK`), set by
TORUS_LINK_BANDWIDTH and TORUS_LINK_LATENCY.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

from . import algorithms
from .config import DEFAULT_CHUNK_BYTES, MAX_BYTES, Rule


@dataclass(frozen=True)
class Machine:
    latency: float  # seconds per dependent step (one message's round through the transport)
    bandwidth: float  # bytes per second one rank sends
    reduce_rate: float  # bytes per second one rank reduces
    message_overhead: float  # seconds per extra concurrent message within a step
    # Seconds more per dependent step for each rank beyond one per core on the host: a step
    # waits for peers that must first get a core (`on_host`).
    crowded_latency: float = 0.0

    def seconds(self, terms: "Terms") -> float:
        return (terms.steps * self.latency + terms.wire_bytes / self.bandwidth
                + terms.reduced_bytes / self.reduce_rate + terms.extra_messages * self.message_overhead)

    def with_memory(self, gbps: float) -> "Machine":
        """This shared-memory machine on a host whose memory moves `gbps` (read + written, all
        cores at once; bench.memory_bound): over shared memory both copying and reducing stream
        through memory, so they scale with it."""
        scale = gbps / SHM_FIT_MEMORY_GBPS
        return dataclasses.replace(self, bandwidth=self.bandwidth * scale, reduce_rate=self.reduce_rate * scale)

    def on_host(self, ranks: int, cores: int) -> "Machine":
        """This machine with `ranks` ranks sharing `cores` cores: each step costs
        crowded_latency x (ranks per core - 1) more where ranks outnumber cores."""
        crowding = max(0.0, ranks / max(cores, 1) - 1.0)
        return dataclasses.replace(self, latency=self.latency + self.crowded_latency * crowding,
                                   crowded_latency=0.0)


# Fitted to the 4- and 8-rank runs of BENCHMARKS.md (2 cores, TCP loopback, ranks outnumbering
# cores) by benchmarks/fit_cost_model.py.
DEFAULT_MACHINE = Machine(latency=260e-6, bandwidth=0.41e9, reduce_rate=2.5e9, message_overhead=230e-6)
# Fitted to the 2-, 4- and 8-rank shared-memory runs on 2 cores, calls on the calling thread
# (benchmarks/results/cost_model_fit_shm_issue18.txt).
# The memory bandwidth of the host SHM_MACHINE was fitted on (2 processes copying 64 MiB at once
# with plain stores, HostMemory.plain_gbps,
# issue 42); a tuning file's measured figure scales it to another host (Machine.with_memory).
SHM_FIT_MEMORY_GBPS = 27.3
SHM_MACHINE = Machine(latency=2.5e-6, bandwidth=5.06e9, reduce_rate=10.0e9, message_overhead=10.9e-6,
                      crowded_latency=21.5e-6)
# Across hosts (shm+tcp: shared memory inside each host) the network bounds what the model sees.
# ofi over libfabric's tcp provider costs what torus's TCP does (BENCHMARKS.md, issue 31); on an
# RDMA fabric the tuner fits its own (python -m torch_torus.tune).
MACHINES = {"tcp": DEFAULT_MACHINE, "shm": SHM_MACHINE, "shm+tcp": DEFAULT_MACHINE, "ofi": DEFAULT_MACHINE,
            "shm+ofi": DEFAULT_MACHINE}

# TCP payload per byte a link carries: 1448 payload bytes (MSS with timestamps) per 1538-byte
# Ethernet frame at MTU 1500 (preamble and gap included). TCP measured 0.93-0.96 of a tbf-shaped
# link's rate on the cluster emulator (BENCHMARKS.md, multi-host).
TCP_PAYLOAD_SHARE = 1448 / 1538


@dataclass(frozen=True)
class Link:
    """A host's network link as TCP across hosts sees it ("tcp across hosts")."""

    bandwidth: float  # payload bytes per second through one host's link, each direction
    latency: float  # seconds a message takes from host to host (one dependent step)

    @classmethod
    def of(cls, rate_bytes: float, latency: float) -> "Link":
        """From the link's nominal rate in bytes/s (10 Gbit/s: 1.25e9), as TORUS_LINK_BANDWIDTH gives it."""
        return cls(bandwidth=rate_bytes * TCP_PAYLOAD_SHARE, latency=latency)


# The default when TORUS_LINK_BANDWIDTH / TORUS_LINK_LATENCY are not set: 10 Gbit/s Ethernet.
HOST_LINK = Link.of(10e9 / 8, 20e-6)


@dataclass(frozen=True)
class Terms:
    """What one rank does in an allreduce: the model's time is linear in these, so measured
    times fit the machine figures by least squares (benchmarks/fit_cost_model.py)."""

    steps: float
    wire_bytes: float
    reduced_bytes: float
    extra_messages: float

    def __add__(self, other: "Terms") -> "Terms":
        return Terms(self.steps + other.steps, self.wire_bytes + other.wire_bytes,
                     self.reduced_bytes + other.reduced_bytes, self.extra_messages + other.extra_messages)


def _log2_floor(n: int) -> int:
    return n.bit_length() - 1


# -- Each algorithm's steps: the one description ------------------------------------------------

@dataclass(frozen=True)
class Flows:
    """Who sends to whom in a step, per byte of the step's S: `senders[i]` sends `share` to
    `receivers[i]` (pairwise), or every sender sends `share` to every receiver but itself."""

    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    share: float
    pairwise: bool = True


@dataclass(frozen=True)
class Step:
    """`repeat` dependent steps alike. Bytes are per byte of S // `divisor` (the torus's column
    phase works on each rank's S // c): the most one rank sends and reduces in one of them, in
    `messages` concurrent messages; `flows` say to whom (none: through shared memory, every rank
    on one host). `single_copy`: the bytes are copied once between the ranks' own buffers, where
    a message is copied twice (into a shared slot and out of it)."""

    repeat: int
    sent: float
    reduced: float
    messages: int = 1
    flows: tuple[Flows, ...] = ()
    divisor: int = 1
    single_copy: bool = False


def _ring(ranks: Sequence[int], reduces: bool) -> list[Step]:
    """A ring reduce-scatter (`reduces`) or allgather over `ranks`: n-1 steps, each rank sending
    1/n of S to the next (ring_pass.cc)."""
    n = len(ranks)
    if n < 2:
        return []
    flows = Flows(tuple(ranks), tuple(ranks[1:]) + (ranks[0],), 1 / n)
    return [Step(n - 1, 1 / n, 1 / n if reduces else 0.0, 1, (flows,))]


def _ring_allreduce(ranks: Sequence[int]) -> list[Step]:
    return _ring(ranks, True) + _ring(ranks, False)


def _exchange(pairs: Sequence[tuple[int, int]], share: float, reduces: bool = True) -> Step:
    """Each pair sends `share` both ways in one step (partner_exchange.cc)."""
    first, second = tuple(a for a, _ in pairs), tuple(b for _, b in pairs)
    return Step(1, share, share if reduces else 0.0, 1, (Flows(first + second, second + first, share),))


def _folded(ranks: Sequence[int], rounds: Callable[[list[int]], list[Step]]) -> list[Step]:
    """power_of_two_fold.cc: ranks 2i+1 < 2(n-p) hand their buffer to 2i, the p remaining ranks
    run `rounds(remaining)`, and 2i hands the result back."""
    n = len(ranks)
    p = 1 << _log2_floor(n)
    pairs = n - p
    remaining = [ranks[2 * i] if i < pairs else ranks[i + pairs] for i in range(p)]
    if not pairs:
        return rounds(remaining)
    odd, even = tuple(ranks[2 * i + 1] for i in range(pairs)), tuple(ranks[2 * i] for i in range(pairs))
    fold = Step(1, 1.0, 1.0, 1, (Flows(odd, even, 1.0),))
    unfold = Step(1, 1.0, 0.0, 1, (Flows(even, odd, 1.0),))
    return [fold] + rounds(remaining) + [unfold]


def _partners(ranks: Sequence[int], distance: int) -> list[tuple[int, int]]:
    return [(ranks[k], ranks[k ^ distance]) for k in range(len(ranks)) if k < k ^ distance]


def _recursive_doubling(ranks: Sequence[int]) -> list[Step]:
    def rounds(remaining):
        return [_exchange(_partners(remaining, 1 << i), 1.0) for i in range(_log2_floor(len(remaining)))]
    return _folded(ranks, rounds)


def _rabenseifner(ranks: Sequence[int]) -> list[Step]:
    def rounds(remaining):
        p = len(remaining)
        distances = [1 << i for i in range(_log2_floor(p))]
        # Halving at distance d sends d of the p blocks and reduces what arrives; doubling sends
        # the same, in reverse order, and copies.
        return [_exchange(_partners(remaining, d), d / p, halving)
                for halving, d in [(True, d) for d in reversed(distances)] + [(False, d) for d in distances]]
    return _folded(ranks, rounds)


def _direct(ranks: Sequence[int]) -> list[Step]:
    """Every rank sends 1/n of S to every other, twice: it reduces the slices of its own block,
    then sends the result to all (direct_pass.cc)."""
    n = len(ranks)
    flows = (Flows(tuple(ranks), tuple(ranks), 1 / n, pairwise=False),)
    return [Step(1, (n - 1) / n, (n - 1) / n, n - 1, flows), Step(1, (n - 1) / n, 0.0, n - 1, flows)]


def _one_shot(ranks: Sequence[int]) -> list[Step]:
    """One step: S copied into shared memory, the n-1 other ranks' buffers reduced."""
    return [Step(1, 1.0, len(ranks) - 1.0)]


def _two_shot(ranks: Sequence[int]) -> list[Step]:
    """Each rank reduces its 1/n slice of every buffer, then writes it into the others'."""
    n = len(ranks)
    return [Step(1, (n - 1) / n, (n - 1) / n, single_copy=True), Step(1, (n - 1) / n, 0.0, single_copy=True)]


_ALLREDUCE_STEPS: dict[str, Callable[[Sequence[int]], list[Step]]] = {
    "ring": _ring_allreduce, "direct": _direct, "recursive_doubling": _recursive_doubling,
    "rabenseifner": _rabenseifner, "one_shot": _one_shot, "two_shot": _two_shot,
}


def _side_by_side(step_lists: list[list[Step]]) -> list[Step]:
    """Steps of equal shape that disjoint Comms (the rows, the columns) run at the same time."""
    return [dataclasses.replace(group[0], flows=tuple(f for step in group for f in step.flows))
            for group in zip(*step_lists)]


Call = tuple[Step, ...]


@functools.lru_cache(maxsize=256)
def allreduce_calls(algorithm: str, ranks: tuple[int, ...], rows: tuple[tuple[int, ...], ...] | None = None,
                    inner: str = "ring") -> tuple[Call, ...]:
    """An allreduce over `ranks` as the collective calls it makes, each as its steps: one call,
    but for the torus over the grid `rows` (torus_allreduce.cc): a ring reduce-scatter along
    every row, `inner` on each rank's S // c along every column, a ring allgather along every
    row. Without a grid the torus runs as the ring."""
    if len(ranks) < 2:
        return ()
    if algorithm == "torus":
        if rows is None:
            return allreduce_calls("ring", ranks)
        cols = len(rows[0])
        columns = [tuple(row[j] for row in rows) for j in range(cols)]
        column_phase = _side_by_side([allreduce_steps(inner, column) for column in columns])
        return (tuple(_side_by_side([_ring(row, True) for row in rows])),
                tuple(dataclasses.replace(step, divisor=step.divisor * cols) for step in column_phase),
                tuple(_side_by_side([_ring(row, False) for row in rows])))
    if algorithm not in _ALLREDUCE_STEPS:
        raise ValueError(f"no cost model for allreduce algorithm {algorithm!r}")
    return (tuple(_ALLREDUCE_STEPS[algorithm](ranks)),)


def allreduce_steps(algorithm: str, ranks: tuple[int, ...], rows: tuple[tuple[int, ...], ...] | None = None,
                    inner: str = "ring") -> list[Step]:
    """allreduce_calls' steps, one call after another."""
    return [step for call in allreduce_calls(algorithm, ranks, rows, inner) for step in call]


def row_major(grid_shape: tuple[int, int] | None) -> tuple[tuple[int, ...], ...] | None:
    """The grid's rows as ranks, rows of consecutive ranks (topology's layout on one host)."""
    if grid_shape is None:
        return None
    rows, cols = grid_shape
    return tuple(tuple(range(r * cols, (r + 1) * cols)) for r in range(rows))


def phase_calls(calls: tuple[Call, ...], phase: str) -> tuple[Call, ...]:
    """Of the torus's three calls, its row phases ("rows": the reduce-scatter and the allgather)
    or its column phase ("columns"); "all", or any other allreduce's calls: every call."""
    if phase == "all" or len(calls) != 3:
        return calls
    return {"rows": (calls[0], calls[2]), "columns": (calls[1],)}[phase]


def step_terms(step: Step, nbytes: int) -> Terms:
    """What one rank does in `step` of an allreduce of `nbytes`."""
    s = float(nbytes // step.divisor)
    return Terms(step.repeat, step.repeat * step.sent * s, step.repeat * step.reduced * s,
                 step.repeat * (step.messages - 1))


@functools.lru_cache(maxsize=1024)
def _terms_per_byte(algorithm: str, n: int, grid_shape: tuple[int, int] | None, inner: str,
                    phase: str = "all") -> tuple[tuple[int, Terms], ...]:
    """The terms of the steps that work on S // d, summed for S // d = 1, by divisor d."""
    rows = row_major(grid_shape) if algorithm == "torus" else None
    by_divisor: dict[int, Terms] = {}
    for call in phase_calls(allreduce_calls(algorithm, tuple(range(n)), rows, inner), phase):
        for step in call:
            by_divisor[step.divisor] = by_divisor.get(step.divisor, Terms(0, 0, 0, 0)) + step_terms(step, step.divisor)
    return tuple(by_divisor.items())


def allreduce_terms(algorithm: str, nbytes: int, n: int, grid_shape: tuple[int, int] | None = None,
                    inner: str = "ring", phase: str = "all") -> Terms:
    """What one rank does in an allreduce of `nbytes` over n ranks (for the torus, `phase` may
    pick its row or column phases)."""
    total = Terms(0, 0, 0, 0)
    for divisor, per_byte in _terms_per_byte(algorithm, n, grid_shape, inner, phase):
        s = float(nbytes // divisor)
        total += Terms(per_byte.steps, per_byte.wire_bytes * s, per_byte.reduced_bytes * s, per_byte.extra_messages)
    return total


# -- Across hosts -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Crossing:
    """What one of a step's repeats puts between groups of ranks (hosts, leaf switches), per
    byte of the step's S."""

    out: dict  # group -> bytes it sends to other groups
    into: dict  # group -> bytes it receives from other groups
    within: float  # the most one rank sends to ranks of its own group

    @property
    def busiest(self) -> float:
        """Bytes over the busiest group's link, in its busier direction."""
        return max([*self.out.values(), *self.into.values(), 0.0])


def crossing(step: Step, group_of: Sequence) -> Crossing:
    """Where `step`'s flows go, with rank r in group `group_of[r]`."""
    out: defaultdict = defaultdict(float)
    into: defaultdict = defaultdict(float)
    within: defaultdict = defaultdict(float)
    for flows in step.flows:
        share = flows.share
        if flows.pairwise:
            for source, destination in zip(flows.senders, flows.receivers):
                source_group, destination_group = group_of[source], group_of[destination]
                if source_group != destination_group:
                    out[source_group] += share
                    into[destination_group] += share
                else:
                    within[source] += share
            continue
        senders = Counter(group_of[r] for r in flows.senders)
        receivers = Counter(group_of[r] for r in flows.receivers)
        for group, count in senders.items():
            if len(flows.receivers) > receivers[group]:
                out[group] += share * count * (len(flows.receivers) - receivers[group])
        for group, count in receivers.items():
            if len(flows.senders) > senders[group]:
                into[group] += share * count * (len(flows.senders) - senders[group])
        receiving = set(flows.receivers)
        for source in flows.senders:
            peers = receivers[group_of[source]] - (source in receiving)
            if peers:
                within[source] += share * peers
    return Crossing(dict(out), dict(into), max(within.values(), default=0.0))


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks live: `hosts[r]` is rank r's host (any hashable identity), `rows`
    the torus grid's rows as rank lists (None without a grid)."""

    hosts: tuple
    rows: tuple[tuple[int, ...], ...] | None = None

    @property
    def host_count(self) -> int:
        return len(set(self.hosts))


@dataclass(frozen=True)
class HostPattern:
    """What an allreduce of S bytes puts on the host links: linear in S."""

    link_share: float  # bytes over the busiest host link, one direction, per byte of S
    crossing_steps: int  # dependent steps in which some message crosses hosts
    sent_share: dict  # host -> bytes it sends to other hosts, per byte of S


def _placed_calls(algorithm: str, placement: Placement, inner: str) -> tuple[Call, ...]:
    calls = allreduce_calls(algorithm, tuple(range(len(placement.hosts))), placement.rows, inner)
    if placement.host_count > 1 and any(not step.flows for call in calls for step in call):
        raise ValueError(f"{algorithm} runs in shared memory: every rank must be on one host")
    return calls


@functools.lru_cache(maxsize=256)
def host_pattern(algorithm: str, placement: Placement, inner: str = "ring", phase: str = "all") -> HostPattern:
    """The bytes each host's link carries and the steps that cross hosts, for an allreduce of
    S = 1 byte over a group placed as `placement` (for the torus, `phase` may pick its row
    phases, "rows", or its column phase, "columns")."""
    calls = phase_calls(_placed_calls(algorithm, placement, inner), phase)
    hosts = placement.hosts
    sent: dict = {h: 0.0 for h in hosts}
    received: dict = {h: 0.0 for h in hosts}
    crossing_steps = 0
    for step in (step for call in calls for step in call):
        traffic = crossing(step, hosts)
        for host, share in traffic.out.items():
            sent[host] += step.repeat * share / step.divisor
        for host, share in traffic.into.items():
            received[host] += step.repeat * share / step.divisor
        crossing_steps += step.repeat if traffic.out else 0
    link_share = max(max(sent.values()), max(received.values()))
    return HostPattern(link_share, crossing_steps, sent)


@dataclass(frozen=True)
class Round:
    """One round of recursive doubling or Rabenseifner (or their fold), per byte of S: rounds run
    one after another, and within a round the transfer and the reduction overlap."""

    sent: float  # bytes a rank sends
    reduced: float  # bytes a rank reduces
    link_share: float  # bytes over the busiest host link, one direction
    crosses: bool


@functools.lru_cache(maxsize=256)
def host_rounds(algorithm: str, placement: Placement) -> tuple[Round, ...]:
    """recursive_doubling's or rabenseifner's rounds over a group placed as `placement`."""
    rounds = []
    for step in (step for call in _placed_calls(algorithm, placement, "ring") for step in call):
        traffic = crossing(step, placement.hosts)
        rounds.append(Round(step.sent, step.reduced, traffic.busiest, bool(traffic.out)))
    return tuple(rounds)


def _link_seconds(pattern: HostPattern, nbytes: int, link: Link) -> float:
    return pattern.link_share * nbytes / link.bandwidth + pattern.crossing_steps * link.latency


# Chunks each phase of the torus keeps in flight (the catalog's export of kChunksInFlight): a
# torus segment holds columns x this x the chunk size.
CHUNKS_IN_FLIGHT = algorithms.CHUNKS_IN_FLIGHT


def torus_segments(nbytes: int, cols: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Segments torus_allreduce.cc cuts `nbytes` into: the column phase of one overlaps the row
    phases of the others, so with one segment nothing overlaps."""
    return max(1, math.ceil(nbytes / (cols * CHUNKS_IN_FLIGHT * chunk_bytes)))


def allreduce_seconds(algorithm: str, nbytes: int, n: int, grid_shape: tuple[int, int] | None = None,
                      inner: str = "ring", machine: Machine = DEFAULT_MACHINE,
                      placement: Placement | None = None, link: Link = HOST_LINK,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> float:
    """Predicted time of one allreduce of `nbytes` over `n` ranks; with a placement on several
    hosts, the larger of the ranks' time and the busiest host link's.

    The torus across hosts runs its row phases (R: within hosts when rows are hosts) and its
    column phase (C: across) one after the other per segment, overlapping one segment's column
    phase with the others' row phases, so with k segments it takes at least
    max(R, C) + min(R, C)/k: R + C for one segment (4 MiB at 2 columns), about max(R, C) for many.
    """
    local = machine.seconds(allreduce_terms(algorithm, nbytes, n, grid_shape, inner))
    if placement is None or placement.host_count < 2:
        return local
    seconds = max(local, _link_seconds(host_pattern(algorithm, placement, inner), nbytes, link))
    if algorithm in ("recursive_doubling", "rabenseifner"):
        s = float(nbytes)
        by_round = sum(max(machine.seconds(Terms(1, r.sent * s, r.reduced * s, 0)),
                           r.link_share * s / link.bandwidth + (link.latency if r.crosses else 0.0))
                       for r in host_rounds(algorithm, placement))
        seconds = max(seconds, by_round)
    if algorithm == "torus" and placement.rows is not None and grid_shape is not None:
        rows, cols = grid_shape
        row_phases = max(machine.seconds(allreduce_terms("torus", nbytes, n, grid_shape, inner, "rows")),
                         _link_seconds(host_pattern("torus", placement, inner, "rows"), nbytes, link))
        column_phase = max(machine.seconds(allreduce_terms("torus", nbytes, n, grid_shape, inner, "columns")),
                           _link_seconds(host_pattern("torus", placement, inner, "columns"), nbytes, link))
        k = torus_segments(nbytes, cols, chunk_bytes) if rows > 1 and cols > 1 else 1
        seconds = max(seconds, max(row_phases, column_phase) + min(row_phases, column_phase) / k)
    return seconds


# Across hosts, candidates predicted within this fraction of the fastest count as tied. Of them,
# the one that puts the fewest bytes on the busiest host link wins, then the first in candidate
# order (ring, torus, direct, recursive_doubling, rabenseifner). The bytes over a link are exact;
# the ranks' own terms come from a machine fitted on one loaded host, and the link term counts
# bytes, not how steadily they flow: the ring keeps one TCP stream per link direction busy for
# the whole call, the others run several streams at once or switch peers between dependent
# rounds. With one rank per host, where ring, torus, direct and rabenseifner all put 2S(n-1)/n
# on each link, the emulated cluster measured the ring 1.07-1.43x faster than each of them at
# 16 and 64 MiB in four runs (BENCHMARKS.md, multi-host). 3% rather than 5%: at 4 hosts x 2 ranks, 4 MiB, the
# one-segment torus is predicted 4% behind the ring and measured 0-10% behind.
LINK_TIE = 0.03


def best_allreduce(nbytes: int, n: int, candidates: tuple[str, ...], grid_shape: tuple[int, int] | None,
                   inner: str, machine: Machine = DEFAULT_MACHINE, placement: Placement | None = None,
                   link: Link = HOST_LINK, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    seconds = {a: allreduce_seconds(a, nbytes, n, grid_shape, inner, machine, placement, link, chunk_bytes)
               for a in candidates}
    fastest = min(seconds.values())
    if placement is None or placement.host_count < 2:
        return min(candidates, key=seconds.__getitem__)
    tied = [a for a in candidates if seconds[a] <= fastest * (1 + LINK_TIE)]
    return min(tied, key=lambda a: round(host_pattern(a, placement, inner).link_share, 9))


def auto_allreduce_rules(n: int, candidates: tuple[str, ...], grid_shape: tuple[int, int] | None,
                         inner: str, machine: Machine = DEFAULT_MACHINE, placement: Placement | None = None,
                         link: Link = HOST_LINK, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[Rule, ...]:
    """Rules covering every size with the algorithm the model predicts fastest."""
    def best(size: int) -> str:
        return best_allreduce(size, n, candidates, grid_shape, inner, machine, placement, link, chunk_bytes)

    samples = [1 << k for k in range(41)] + [MAX_BYTES]
    rules: list[Rule] = []
    lo, current, known = 0, best(0), 0  # invariant: best(known) == current
    for sample in samples:
        while best(sample) != current:
            # Bisect for the first size after `known` where `current` stops winning.
            left, right = known, sample
            while right - left > 1:
                middle = (left + right) // 2
                left, right = (middle, right) if best(middle) == current else (left, middle)
            rules.append(Rule(current, lo, right - 1))
            lo, current, known = right, best(right), right
        known = sample
    rules.append(Rule(current, lo, MAX_BYTES))
    return tuple(rules)
