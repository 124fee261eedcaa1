"""The algorithm tables a group runs by: the user's TORUS_<COLLECTIVE> rules, with every size
they leave uncovered filled by the automatic choice (the cost model for allreduce, fixed
thresholds for the others)."""

from __future__ import annotations

import os

from . import algorithms
from .config import ALGORITHMS, DEFAULT_CHUNK_BYTES, MAX_BYTES, SHARED_MEMORY_ALGORITHMS, Rule
from .cost_model import HOST_LINK, MACHINES, Link, Machine, Placement, auto_allreduce_rules
from .topology import Grid


def size_thresholds(collective: str) -> tuple[Rule, ...]:
    """The automatic choice for a collective without a cost model yet, from the catalog's
    thresholds: a latency-bound algorithm for small messages, the bandwidth-bound one above."""
    rules, lo = [], 0
    for entry in sorted(algorithms.BY_COLLECTIVE[collective], key=lambda a: a.auto_up_to_bytes):
        if lo > MAX_BYTES:
            break  # the ones left run only where they are asked for, or instead of another
        rules.append(Rule(entry.name, lo, min(entry.auto_up_to_bytes, MAX_BYTES)))
        lo = entry.auto_up_to_bytes + 1
    return tuple(rules)


def allreduce_candidates(grid: Grid | None, transport: str = "tcp") -> tuple[str, ...]:
    """The allreduce algorithms auto chooses among for a group (and the tuner measures): the
    torus only where the group has a grid, since without one it runs as the ring; one_shot and
    two_shot only over shared memory, and listed first there."""
    usable = [a for a in ALGORITHMS["allreduce"] if a not in algorithms.NEEDS_GRID or grid is not None]
    if transport != "shm":
        return tuple(a for a in usable if a not in SHARED_MEMORY_ALGORITHMS)
    # First where the model ties: over shared memory they move the same bytes as ring and
    # recursive doubling with fewer copies and no message protocol.
    return tuple(sorted(usable, key=lambda a: a not in SHARED_MEMORY_ALGORITHMS))


def placement_of(hosts: list[str] | None, grid: Grid | None) -> Placement | None:
    """The cost model's view of where a group's ranks live (None: all on one host, or unknown)."""
    if hosts is None or len(set(hosts)) < 2:
        return None
    return Placement(tuple(hosts), grid.rows if grid else None)


def auto_rules(collective: str, size: int, grid: Grid | None, inner: str, transport: str = "tcp",
               machine: Machine | None = None, hosts: list[str] | None = None,
               link: Link = HOST_LINK, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               cores: int | None = None) -> tuple[Rule, ...]:
    """`hosts`: each rank's host identity; when they differ, allreduce's cost model counts the
    bytes over each host's `link` (and the torus's segments of `chunk_bytes` chunks). `cores`:
    the cores of the host a shared-memory group's ranks share (default: this host's)."""
    if collective == "allreduce":
        machine = machine or MACHINES[transport]
        if transport == "shm":
            # The host's core count, not this process's affinity: every rank of the group must
            # derive the same table, and ranks pinned to different cores see different affinities.
            machine = machine.on_host(size, cores or os.cpu_count() or 1)
        return auto_allreduce_rules(size, allreduce_candidates(grid, transport), grid.shape if grid else None,
                                    inner, machine, placement_of(hosts, grid), link, chunk_bytes)
    return size_thresholds(collective)


def overlay(user: tuple[Rule, ...], automatic: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """`user` rules where they apply, `automatic` ones clipped to the gaps between them."""
    gaps, lo = [], 0
    for rule in user:
        if rule.lo > lo:
            gaps.append((lo, rule.lo - 1))
        lo = rule.hi + 1 if rule.hi < MAX_BYTES else None
        if lo is None:
            break
    if lo is not None:
        gaps.append((lo, MAX_BYTES))
    filled = [Rule(a.algorithm, max(a.lo, g_lo), min(a.hi, g_hi))
              for g_lo, g_hi in gaps for a in automatic if a.lo <= g_hi and a.hi >= g_lo]
    merged: list[Rule] = []
    for rule in sorted(list(user) + filled, key=lambda r: r.lo):
        if merged and merged[-1].algorithm == rule.algorithm and merged[-1].hi + 1 == rule.lo:
            merged[-1] = Rule(rule.algorithm, merged[-1].lo, rule.hi)
        else:
            merged.append(rule)
    return tuple(merged)


def link_of(values: dict) -> Link:
    """The host link TORUS_LINK_BANDWIDTH and TORUS_LINK_LATENCY describe."""
    return Link.of(values["link_bandwidth"], values["link_latency"])


def resolve_tables(values: dict, size: int, grid: Grid | None, transport: str = "tcp",
                   machine: Machine | None = None,
                   tuned_allreduce: tuple[Rule, ...] | None = None,
                   hosts: list[str] | None = None) -> dict[str, tuple[Rule, ...]]:
    """Per collective, rules covering every size from 0 to max. `tuned_allreduce` (a tuning
    file's table for this group) replaces the cost model as allreduce's automatic choice.
    `hosts`, each rank's host identity, lets the cost model count bytes over host links."""
    def automatic(collective: str) -> tuple[Rule, ...]:
        if collective == "allreduce" and tuned_allreduce is not None:
            return tuned_allreduce
        return auto_rules(collective, size, grid, values["torus_inner"], transport, machine, hosts,
                          link_of(values), values["chunk_bytes"])

    return {collective: overlay(values[collective], automatic(collective)) for collective in ALGORITHMS}


def describe(tables: dict[str, tuple[Rule, ...]]) -> str:
    return "; ".join(f"{c}={';'.join(str(r) for r in rules)}" for c, rules in tables.items())
