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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def allreduce_seconds(algorithm: str, nbytes: int, n: int, grid_shape: tuple[int, int] | None = None,
                      inner: str = "ring", machine: Machine = DEFAULT_MACHINE) -> float:
    """Predicted time of one allreduce of `nbytes` over `n` ranks."""
    return machine.seconds(allreduce_terms(algorithm, nbytes, n, grid_shape, inner))


def best_allreduce(nbytes: int, n: int, candidates: tuple[str, ...], grid_shape: tuple[int, int] | None,
                   inner: str, machine: Machine = DEFAULT_MACHINE) -> str:
    return min(candidates, key=lambda a: allreduce_seconds(a, nbytes, n, grid_shape, inner, machine))


def auto_allreduce_rules(n: int, candidates: tuple[str, ...], grid_shape: tuple[int, int] | None,
                         inner: str, machine: Machine = DEFAULT_MACHINE) -> tuple[Rule, ...]:
    """Rules covering every size with the algorithm the model predicts fastest."""
    def best(size: int) -> str:
        return best_allreduce(size, n, candidates, grid_shape, inner, machine)

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
