"""The algorithm catalog, read from the C++ core, where every algorithm is declared once
(csrc/backend/algorithm_catalog.cc): its name, the collective it serves, what it needs to run
and what runs instead. Configuration, selection, the cost model, the tuner and the bench take
their lists from here."""

from __future__ import annotations

from dataclasses import dataclass

from . import _C


@dataclass(frozen=True)
class Requirement:
    need: str  # "grid", "shared_memory", "single_copy" or "fits_slot"
    instead: str  # the algorithm that runs where the group lacks the need


@dataclass(frozen=True)
class Algorithm:
    collective: str
    name: str
    needs: tuple[Requirement, ...]
    torus_inner: bool  # may run a torus column
    auto_up_to_bytes: int  # the automatic choice up to this size (collectives chosen by size alone)

    def needs_any(self, *needs: str) -> bool:
        return any(r.need in needs for r in self.needs)


CATALOG: tuple[Algorithm, ...] = tuple(
    Algorithm(e["collective"], e["name"], tuple(Requirement(r["need"], r["instead"]) for r in e["needs"]),
              e["torus_inner"], e["auto_up_to_bytes"])
    for e in _C.algorithm_catalog())

# A collective's algorithms in catalog order; the first is what it runs without a rule.
BY_COLLECTIVE: dict[str, tuple[Algorithm, ...]] = {}
for _entry in CATALOG:
    BY_COLLECTIVE[_entry.collective] = BY_COLLECTIVE.get(_entry.collective, ()) + (_entry,)
del _entry

# Collectives with a choice of algorithm (a TORUS_<COLLECTIVE> setting each), and their names.
CHOOSABLE: dict[str, tuple[str, ...]] = {
    collective: tuple(a.name for a in entries) for collective, entries in BY_COLLECTIVE.items() if len(entries) > 1}
# Collectives with one algorithm each, so no setting chooses among several.
SINGLE: dict[str, str] = {
    collective: entries[0].name for collective, entries in BY_COLLECTIVE.items() if len(entries) == 1}

ALLREDUCE: tuple[str, ...] = CHOOSABLE["allreduce"]
# Allreduce algorithms that can run a torus column.
TORUS_INNER: tuple[str, ...] = tuple(a.name for a in BY_COLLECTIVE["allreduce"] if a.torus_inner)
# Allreduce algorithms that need every rank of the group in one host's shared memory.
SHARED_MEMORY: tuple[str, ...] = tuple(
    a.name for a in BY_COLLECTIVE["allreduce"] if a.needs_any("shared_memory"))
# Allreduce algorithms that need a torus grid, and the one whose grids the tools tabulate.
NEEDS_GRID: tuple[str, ...] = tuple(a.name for a in BY_COLLECTIVE["allreduce"] if a.needs_any("grid"))
GRID_ALLREDUCE: str = NEEDS_GRID[0]

# Shared with the algorithms: the chunks a pipelined algorithm keeps in flight per peer, the
# default chunk, the one-shot shared-memory slot, the message layer's flow control, and the
# largest collective run on the calling thread.
CHUNKS_IN_FLIGHT: int = _C.CHUNKS_IN_FLIGHT
DEFAULT_CHUNK_BYTES: int = _C.DEFAULT_CHUNK_BYTES
DEFAULT_EAGER_BYTES: int = _C.DEFAULT_EAGER_BYTES
DEFAULT_EAGER_WINDOW: int = _C.DEFAULT_EAGER_WINDOW
DEFAULT_INLINE_BYTES: int = _C.DEFAULT_INLINE_BYTES
SHM_SLOT_BYTES: int = _C.SHM_SLOT_BYTES


def markdown_table() -> str:
    """The catalog as docs/algorithms.md shows it (tests/test_docs.py checks that the two agree)."""
    lines = ["| collective | algorithm | needs (else runs instead) | torus column | auto |", "|---|---|---|---|---|"]
    for a in CATALOG:
        needs = ", ".join(f"{r.need.replace('_', ' ')} (else {r.instead})" for r in a.needs) or "-"
        # Entries for every size: the first is the automatic choice, the rest run where asked for
        # or in its place.
        unbounded = [b for b in BY_COLLECTIVE[a.collective] if b.auto_up_to_bytes >= (1 << 64) - 1]
        if a.auto_up_to_bytes == 0:
            auto = "cost model"
        elif a in unbounded and a is not unbounded[0]:
            auto = "where asked for, or instead"
        elif len(BY_COLLECTIVE[a.collective]) == len(unbounded):
            auto = "always"
        elif a.auto_up_to_bytes >= (1 << 64) - 1:
            auto = "above the others"
        else:
            auto = f"up to {a.auto_up_to_bytes} bytes"
        lines.append(f"| {a.collective} | {a.name} | {needs} | {'yes' if a.torus_inner else ''} | {auto} |")
    return "\n".join(lines)


def instead(collective: str, name: str, need: str) -> str:
    """What runs in place of `name` where the group lacks `need` (`name` itself if it needs none)."""
    return next((r.instead for r in entry(collective, name).needs if r.need == need), name)


def entry(collective: str, name: str) -> Algorithm:
    for algorithm in BY_COLLECTIVE[collective]:
        if algorithm.name == name:
            return algorithm
    raise KeyError(f"{collective} has no algorithm named {name!r}")
