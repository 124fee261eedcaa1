"""How long each AllReduce algorithm takes, from three machine figures (NCCL-style tuning).

    time = steps x latency + bytes on the wire / bandwidth + bytes reduced / reduce_rate

for n ranks and S bytes (p: the largest power of two <= n; the torus: r rows of c ranks):

    ring                2(n-1) steps, 2S(n-1)/n sent, S(n-1)/n reduced
    direct              2 steps of n-1 concurrent messages each, 2S(n-1)/n sent
    recursive_doubling  log2 p steps of S, plus a fold and an unfold of S when n != p
    rabenseifner        2 log2 p steps, 2S(p-1)/p sent, plus the fold and unfold when n != p
    torus               a ring reduce-scatter and allgather along the rows, the inner
                        algorithm on S/c along the columns
    one_shot            1 step; S copied into shared memory, (n-1)S reduced (shm only)
    two_shot            2 steps; 2S(n-1)/n copied between processes, S(n-1)/n reduced, no
                        messages (shm only)

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

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from .config import MAX_BYTES, Rule


@dataclass(frozen=True)
class Machine:
    latency: float  # seconds per dependent step (one message's round through the transport)
    bandwidth: float  # bytes per second one rank sends
    reduce_rate: float  # bytes per second one rank reduces
    message_overhead: float  # seconds per extra concurrent message within a step

    def seconds(self, terms: "Terms") -> float:
        return (terms.steps * self.latency + terms.wire_bytes / self.bandwidth
                + terms.reduced_bytes / self.reduce_rate + terms.extra_messages * self.message_overhead)


# Fitted to the 4- and 8-rank runs of BENCHMARKS.md (2 cores, TCP loopback, ranks outnumbering
# cores) by benchmarks/fit_cost_model.py.
DEFAULT_MACHINE = Machine(latency=260e-6, bandwidth=0.41e9, reduce_rate=2.5e9, message_overhead=230e-6)
# Fitted to the 4- and 8-rank shared-memory runs (benchmarks/results/cost_model_fit_shm.txt).
SHM_MACHINE = Machine(latency=120e-6, bandwidth=3.51e9, reduce_rate=2.19e9, message_overhead=58e-6)
# Across hosts (shm+tcp: shared memory inside each host) the network bounds what the model sees.
MACHINES = {"tcp": DEFAULT_MACHINE, "shm": SHM_MACHINE, "shm+tcp": DEFAULT_MACHINE}

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


def allreduce_terms(algorithm: str, nbytes: int, n: int, grid_shape: tuple[int, int] | None = None,
                    inner: str = "ring") -> Terms:
    if n <= 1:
        return Terms(0, 0, 0, 0)
    s = float(nbytes)
    p = 1 << _log2_floor(n)
    fold = Terms(0, 0, 0, 0) if n == p else Terms(2, 2 * s, s, 0)
    if algorithm == "ring":
        return Terms(2 * (n - 1), 2 * (n - 1) / n * s, (n - 1) / n * s, 0)
    if algorithm == "direct":
        return Terms(2, 2 * (n - 1) / n * s, (n - 1) / n * s, 2 * (n - 2))
    if algorithm == "recursive_doubling":
        k = math.log2(p)
        return Terms(k, k * s, k * s, 0) + fold
    if algorithm == "rabenseifner":
        return Terms(2 * math.log2(p), 2 * (p - 1) / p * s, (p - 1) / p * s, 0) + fold
    if algorithm == "one_shot":
        return Terms(1, s, (n - 1) * s, 0)
    if algorithm == "two_shot":
        return Terms(2, 2 * (n - 1) / n * s, (n - 1) / n * s, 0)
    if algorithm == "torus":
        if grid_shape is None:
            return allreduce_terms("ring", nbytes, n)
        rows, cols = grid_shape
        row_phases = Terms(2 * (cols - 1), 2 * (cols - 1) / cols * s, (cols - 1) / cols * s, 0)
        return row_phases + allreduce_terms(inner, nbytes // cols, rows)
    raise ValueError(f"no cost model for allreduce algorithm {algorithm!r}")


# -- Across hosts -------------------------------------------------------------------------------

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


# A step: (times it repeats, messages (source rank, destination rank, bytes per byte of S),
# whether the receivers reduce what arrives).
_Step = tuple[int, tuple[tuple[int, int, float], ...], bool]


def _ring_steps(ranks: Sequence[int], share: float, steps: int) -> list[_Step]:
    """`steps` ring steps over `ranks`, each rank sending share/n to the next (ring_pass.cc)."""
    n = len(ranks)
    if n < 2 or steps == 0:
        return []
    return [(steps, tuple((ranks[i], ranks[(i + 1) % n], share / n) for i in range(n)), True)]


def _exchange(pairs: Sequence[tuple[int, int]], share: float, reduces: bool = True) -> _Step:
    """Each pair sends `share` both ways in one step (partner_exchange.cc)."""
    return (1, tuple(m for a, b in pairs for m in ((a, b, share), (b, a, share))), reduces)


def _folded(ranks: Sequence[int], share: float, rounds) -> list[_Step]:
    """power_of_two_fold.cc: ranks 2i+1 < 2(n-p) hand their buffer to 2i, the p remaining ranks
    run `rounds(remaining)`, and 2i hands the result back."""
    n = len(ranks)
    p = 1 << _log2_floor(n)
    pairs = n - p
    remaining = [ranks[2 * i] if i < pairs else ranks[i + pairs] for i in range(p)]
    fold = [(1, tuple((ranks[2 * i + 1], ranks[2 * i], share) for i in range(pairs)), True)] if pairs else []
    unfold = [(1, tuple((ranks[2 * i], ranks[2 * i + 1], share) for i in range(pairs)), False)] if pairs else []
    return fold + rounds(remaining) + unfold


def _recursive_doubling_steps(ranks: Sequence[int], share: float) -> list[_Step]:
    def rounds(rem):
        p = len(rem)
        return [_exchange([(rem[k], rem[k ^ d]) for k in range(p) if k < k ^ d], share)
                for d in (1 << i for i in range(_log2_floor(p)))]
    return _folded(ranks, share, rounds)


def _rabenseifner_steps(ranks: Sequence[int], share: float) -> list[_Step]:
    def rounds(rem):
        p = len(rem)
        distances = [1 << i for i in range(_log2_floor(p))]
        # Halving at distance d sends d of the p blocks and reduces what arrives; doubling sends
        # the same, in reverse order, and copies.
        return [_exchange([(rem[k], rem[k ^ d]) for k in range(p) if k < k ^ d], share * d / p, halving)
                for halving, d in [(True, d) for d in reversed(distances)] + [(False, d) for d in distances]]
    return _folded(ranks, share, rounds)


def _direct_steps(ranks: Sequence[int], share: float) -> list[_Step]:
    """Every rank sends share/n to every other, twice (direct_pass.cc). n(n-1) messages: see
    host_pattern for the sums it takes instead when the group is large."""
    n = len(ranks)
    if n < 2:
        return []
    return [(2, tuple((a, b, share / n) for a in ranks for b in ranks if a != b), True)]


def _allreduce_steps(algorithm: str, ranks: Sequence[int], share: float) -> list[_Step]:
    if len(ranks) < 2:
        return []
    if algorithm == "ring":
        return _ring_steps(ranks, share, 2 * (len(ranks) - 1))
    if algorithm == "direct":
        return _direct_steps(ranks, share)
    if algorithm == "recursive_doubling":
        return _recursive_doubling_steps(ranks, share)
    if algorithm == "rabenseifner":
        return _rabenseifner_steps(ranks, share)
    raise ValueError(f"no host traffic model for allreduce algorithm {algorithm!r}")


def _side_by_side(step_lists: list[list[_Step]]) -> list[_Step]:
    """Steps of equal shape that disjoint Comms (the rows, the columns) run at the same time."""
    return [(group[0][0], tuple(m for _, messages, _ in group for m in messages), group[0][2])
            for group in zip(*step_lists)]


def _torus_steps(rows: Sequence[Sequence[int]], inner: str, phase: str = "all") -> list[_Step]:
    """torus_allreduce.cc: ring reduce-scatter along every row, `inner` on each rank's 1/c share
    along every column, ring allgather along every row. `phase`: "rows" (both row phases),
    "columns", or "all"."""
    cols = len(rows[0])
    row_pass = _side_by_side([_ring_steps(row, 1.0, cols - 1) for row in rows])
    columns = [[row[j] for row in rows] for j in range(cols)]
    column_phase = _side_by_side([_allreduce_steps(inner, column, 1.0 / cols) for column in columns])
    return {"rows": row_pass + row_pass, "columns": column_phase}.get(phase, row_pass + column_phase + row_pass)


@functools.lru_cache(maxsize=256)
def host_pattern(algorithm: str, placement: Placement, inner: str = "ring", phase: str = "all") -> HostPattern:
    """The bytes each host's link carries and the steps that cross hosts, for an allreduce of
    S = 1 byte over a group placed as `placement` (for the torus, `phase` may pick its row or
    column phases alone)."""
    hosts = placement.hosts
    n = len(hosts)
    if algorithm == "direct" and n > 64:
        # Each host sends share/n from each of its k ranks to each of the n - k ranks elsewhere, twice.
        count = {h: hosts.count(h) for h in set(hosts)}
        sent = {h: 2 * k * (n - k) / n for h, k in count.items()}
        return HostPattern(max(sent.values()), 2 if len(count) > 1 else 0, sent)
    if algorithm == "torus" and placement.rows is not None:
        steps = _torus_steps(placement.rows, inner, phase)
    else:
        # The torus without a grid runs as the ring.
        steps = _allreduce_steps("ring" if algorithm == "torus" else algorithm, range(n), 1.0)
    sent: dict = {h: 0.0 for h in hosts}
    received: dict = {h: 0.0 for h in hosts}
    crossing = 0
    for repeat, messages, _ in steps:
        crosses = False
        for source, destination, share in messages:
            if hosts[source] != hosts[destination]:
                sent[hosts[source]] += repeat * share
                received[hosts[destination]] += repeat * share
                crosses = True
        crossing += repeat if crosses else 0
    link_share = max(max(sent.values()), max(received.values()))
    return HostPattern(link_share, crossing, sent)


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
    hosts = placement.hosts
    rounds = []
    for _, messages, reduces in _allreduce_steps(algorithm, range(len(hosts)), 1.0):
        sent: dict = {}
        received: dict = {}
        for source, destination, share in messages:
            if hosts[source] != hosts[destination]:
                sent[hosts[source]] = sent.get(hosts[source], 0.0) + share
                received[hosts[destination]] = received.get(hosts[destination], 0.0) + share
        share = max(m[2] for m in messages)
        rounds.append(Round(share, share if reduces else 0.0,
                            max(list(sent.values()) + list(received.values()) + [0.0]), bool(sent)))
    return tuple(rounds)


def _link_seconds(pattern: HostPattern, nbytes: int, link: Link) -> float:
    return pattern.link_share * nbytes / link.bandwidth + pattern.crossing_steps * link.latency


# Chunks each phase of the torus keeps in flight (kChunksInFlight, csrc/collectives/blocks.h): a
# torus segment holds columns x this x the chunk size.
CHUNKS_IN_FLIGHT = 4
DEFAULT_CHUNK_BYTES = 512 * 1024


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
        s = float(nbytes)
        row_terms = Terms(2 * (cols - 1), 2 * (cols - 1) / cols * s, (cols - 1) / cols * s, 0)
        row_phases = max(machine.seconds(row_terms),
                         _link_seconds(host_pattern("torus", placement, inner, "rows"), nbytes, link))
        column_phase = max(machine.seconds(allreduce_terms(inner, nbytes // cols, rows)),
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
