"""Tuning files: the allreduce table measured on a running job, for `auto` to use later.

`python -m torch_torus.tune` writes one; TORUS_TUNING_FILE names it. A file holds entries keyed
by the job's layout: world size, torus grid shape, ranks per host and transport. A group whose
layout matches an entry takes that entry's table as its automatic allreduce choice; other groups keep
the cost model. User rules (TORUS_ALLREDUCE) still win over both.

    {"format": "torch_torus tuning", "version": 2,
     "entries": [{"world_size": 4, "grid": [2, 2], "ranks_per_host": [4], "transport": "shm",
                  "allreduce": "recursive_doubling:0-262143;ring:262144-max",
                  "measured": {"sizes": [...], "time_us": {"ring": [...], ...}},
                  "timing": "loop", ...}]}

A time of null: the algorithm does not run at that size (one_shot's group runs two_shot above
its shared-memory slot), so it was not measured there and cannot be chosen there.

The version changes whenever the meaning of a field changes; a file of another version is
refused rather than guessed at, since a misread table silently slows every step of training.
Version 2 added the transport: the same 4 ranks rank the algorithms differently over shared
memory and over TCP. "timing" says how the tuner timed the calls (its --timing: "loop", back to
back, or "osu", each after a barrier); it came later within version 2, without changing what the
table means, and an entry without it was timed with loop.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass

from .config import MAX_BYTES, ConfigError, Rule, parse_rules
from .topology import GROUP_TRANSPORTS, Grid

FORMAT = "torch_torus tuning"
VERSION = 2
VARIABLE = "TORUS_TUNING_FILE"


@dataclass(frozen=True)
class Layout:
    """What a tuned table depends on: the same algorithms rank differently on another layout."""

    world_size: int
    grid: tuple[int, int] | None  # rows x columns of the torus, None when there is no grid
    ranks_per_host: tuple[int, ...]  # in order of each host's lowest rank
    transport: str  # "tcp", "shm" or "shm+tcp", as topology.choose_transport decides

    @classmethod
    def of(cls, hosts: list[str], grid: Grid | None, transport: str) -> "Layout":
        counts: dict[str, int] = {}
        for host in hosts:
            counts[host] = counts.get(host, 0) + 1
        return cls(len(hosts), grid.shape if grid else None, tuple(counts.values()), transport)

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "grid": list(self.grid) if self.grid else None,
                "ranks_per_host": list(self.ranks_per_host), "transport": self.transport}

    def __str__(self) -> str:
        grid = f"{self.grid[0]}x{self.grid[1]} grid" if self.grid else "no grid"
        per_host = ",".join(str(k) for k in self.ranks_per_host)
        return (f"{self.world_size} ranks, {grid}, {len(self.ranks_per_host)} host(s) with {per_host} ranks, "
                f"over {self.transport}")


@dataclass(frozen=True)
class Entry:
    layout: Layout
    allreduce: tuple[Rule, ...]
    record: dict  # the entry as stored, measurements included

    @property
    def timing(self) -> str:
        """The tuner's --timing for the measurements; entries from before it had one were timed with loop."""
        return self.record.get("timing", "loop")

    @property
    def range_string(self) -> str:
        """The table as a TORUS_ALLREDUCE value."""
        return ";".join(str(rule) for rule in self.allreduce)


def rules_from_measurements(sizes: list[int], time_us: dict[str, list[float | None]]) -> tuple[Rule, ...]:
    """A table covering every size: the fastest algorithm at each measured size, switching at the
    geometric mean of two measured sizes (they are spaced by a factor, so that is halfway on the
    scale they were chosen on). Below the smallest and above the largest size the nearest
    measurement's winner applies. A time of None (the algorithm does not run at that size) never wins."""
    if not sizes or any(len(times) != len(sizes) for times in time_us.values()):
        raise ValueError("every algorithm needs one time per measured size")
    if any(all(times[i] is None for times in time_us.values()) for i in range(len(sizes))):
        raise ValueError("every measured size needs a time of at least one algorithm")
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    winners = [min((a for a in time_us if time_us[a][i] is not None), key=lambda a: time_us[a][i]) for i in order]
    ordered = [sizes[i] for i in order]
    rules: list[Rule] = []
    lo = 0
    for k, winner in enumerate(winners):
        hi = MAX_BYTES if k == len(winners) - 1 else math.isqrt(ordered[k] * ordered[k + 1])
        if rules and rules[-1].algorithm == winner:
            rules[-1] = Rule(winner, rules[-1].lo, hi)
        else:
            rules.append(Rule(winner, lo, hi))
        lo = hi + 1
    return tuple(rules)


def make_entry(layout: Layout, sizes: list[int], time_us: dict[str, list[float | None]], about: dict) -> dict:
    """An entry as stored: the layout key, the chosen table and the measurements behind it."""
    rules = rules_from_measurements(sizes, time_us)
    return {**layout.to_json(), "allreduce": ";".join(str(r) for r in rules),
            "measured": {"sizes": list(sizes), "time_us": time_us}, **about}


def _problem(path: str, what: str) -> ConfigError:
    return ConfigError(f"{VARIABLE}={path!r}: {what}")


def _layout_of(record: dict, where: str, path: str) -> Layout:
    try:
        world_size = int(record["world_size"])
        grid = record["grid"]
        grid = None if grid is None else (int(grid[0]), int(grid[1]))
        ranks_per_host = tuple(int(k) for k in record["ranks_per_host"])
        transport = record["transport"]
        if transport not in GROUP_TRANSPORTS:
            raise ValueError(f"transport {transport!r} is none of {', '.join(GROUP_TRANSPORTS)}")
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise _problem(path, f"{where} lacks a valid world_size, grid ([rows, columns] or null), "
                             f"ranks_per_host and transport ({type(error).__name__}: {error})") from None
    if sum(ranks_per_host) != world_size:
        raise _problem(path, f"{where}: ranks_per_host {list(ranks_per_host)} do not add up to "
                             f"world_size {world_size}")
    return Layout(world_size, grid, ranks_per_host, transport)


def read(path: str) -> list[Entry]:
    """Every entry of a tuning file; a ConfigError naming the file and what is wrong otherwise."""
    if "\x00" in path:
        raise _problem(path, "is not a file name (it holds a NUL character)")
    try:
        # Not a FIFO, a device or a directory: opening or reading those can block or never end.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise _problem(path, "is not a regular file")
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    except OSError as error:
        raise _problem(path, f"cannot be read ({error.strerror or error})") from None
    except json.JSONDecodeError as error:
        raise _problem(path, f"is not JSON ({error})") from None
    except (UnicodeDecodeError, RecursionError) as error:
        raise _problem(path, f"is not JSON ({type(error).__name__}: {error})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise _problem(path, f"is not a tuning file (no \"format\": \"{FORMAT}\"); "
                             "python -m torch_torus.tune writes them")
    if document.get("version") != VERSION:
        raise _problem(path, f"is version {document.get('version')!r}, and this torch_torus reads "
                             f"version {VERSION}; tune again with python -m torch_torus.tune")
    records = document.get("entries")
    if not isinstance(records, list):
        raise _problem(path, "has no \"entries\" list")
    return entries_of(records, path)


def entries_of(records: list, path: str) -> list[Entry]:
    """The entries of a tuning file's "entries" list (read's, or the one another rank read:
    agreement.py); a ConfigError naming the file and what is wrong otherwise."""
    entries = []
    for index, record in enumerate(records):
        where = f"entry {index}"
        if not isinstance(record, dict):
            raise _problem(path, f"{where} is not an object")
        layout = _layout_of(record, where, path)
        try:
            rules = parse_rules(str(record.get("allreduce", "")), "allreduce")
        except ValueError as error:
            raise _problem(path, f"{where} ({layout}): allreduce {record.get('allreduce')!r}: {error}") from None
        if not rules or rules[0].lo != 0 or rules[-1].hi != MAX_BYTES or any(
                after.lo != before.hi + 1 for before, after in zip(rules, rules[1:])):
            raise _problem(path, f"{where} ({layout}): allreduce {record.get('allreduce')!r} does not "
                                 "cover every size from 0 to max")
        entries.append(Entry(layout, rules, record))
    return entries


def write(path: str, entry: dict) -> None:
    """Add `entry` to the file at `path` (created if missing), replacing one of the same layout."""
    layout = _layout_of(entry, "the new entry", path)
    # A damaged file or one of another version raises here: it is the user's to look at, not
    # ours to overwrite.
    kept = [e.record for e in read(path) if e.layout != layout] if os.path.exists(path) else []
    with open(path, "w") as file:
        json.dump({"format": FORMAT, "version": VERSION, "entries": kept + [entry]}, file, indent=1)
        file.write("\n")


def host_memory_gbps(path: str, entries: list[Entry] | None = None) -> float | None:
    """The host memory bandwidth (GB/s, read + written) of copies with plain stores, as the tuner
    last measured it into the file (its latest entry made on one host), or None: what the cost
    model's shared-memory machine was fitted against. Files written before the streaming copy
    was timed too hold the plain figure under "gbps"."""
    if not path:
        return None
    for entry in reversed(read(path) if entries is None else entries):
        memory = entry.record.get("host_memory")
        if not isinstance(memory, dict):
            continue
        gbps = memory.get("plain_gbps", memory.get("gbps"))
        if isinstance(gbps, (int, float)) and gbps > 0:
            return float(gbps)
    return None


def tuned_allreduce(path: str, hosts: list[str], grid: Grid | None, transport: str,
                    entries: list[Entry] | None = None) -> tuple[Rule, ...] | None:
    """The tuned table for a group of this layout, or None without a file or a matching entry.
    `entries`: the file's, read already."""
    if not path:
        return None
    layout = Layout.of(hosts, grid, transport)
    for entry in read(path) if entries is None else entries:
        if entry.layout == layout:
            return entry.allreduce
    return None
