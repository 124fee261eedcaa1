"""python -m torch_torus.trace DIR: where every rank was when a group hung or failed.

Each rank's flight recorder (TORUS_TRACE_BUFFER) keeps the group's last collectives and
point-to-point calls, and writes them to DIR/rank<r>.json when a collective times out or fails,
when the group is aborted, or on torch_torus.dump_trace(). This reads every rank's file and says
where each rank is; the primary cause: the earliest collective that some rank gave up on, never
reached, or was still in while another had gone past it, with the ranks that never reached it (or
wrote no dump) and the ranks that came to it only after another had given up on it (later
collectives are its consequences); ranks that ran different
collectives at one sequence number (both calls: a different collective, algorithm, dtype,
reduction, root or agreed size, never a shape that differs by design); failed sends and receives;
and, for a rank behind or late, where its Python was. Exits 0 when it finds nothing, 1 when it
finds a problem, 2 when the dumps cannot be read (naming the file and the field); --json prints
the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile

from .agreement import describe_ranks
from .trace_format import DumpError, load, python_stacks

__all__ = ["DumpError", "analyze", "load", "main", "report", "trace_directory"]

# The last collectives whose latest arrival the report names.
_LAST = 5
# Collectives whose element count every rank must agree on: compared where a dump predates
# agreed_bytes (the runtime's own size, which covers every collective).
_SAME_SIZE = ("all_reduce", "broadcast", "reduce")
# The reason torch_torus.dump_trace() gives by default; the recorder's own dumps (other reasons)
# are written on a failure, while the failing call is still started.
_REQUESTED = "requested"
# The innermost frames shown of a thread.
_FRAMES = 4


def trace_directory(base: str, group: str, epoch: str) -> str:
    """The directory of one group's dumps: TORUS_TRACE_DIR (default: torus-trace-<uid> in the
    temporary directory, one per user) / <group name>-<epoch>."""
    base = base or os.path.join(tempfile.gettempdir(), f"torus-trace-{os.getuid()}")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", group) or "group"
    return os.path.join(base, f"{name}-{epoch}")


def _collective(entry: dict) -> str:
    """"all_reduce" of "torus:all_reduce:ring"."""
    parts = entry["profiling_name"].split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _signature(entry: dict) -> str:
    text = f"{entry['profiling_name']} of {entry['input_sizes']} -> {entry['output_sizes']} {entry['input_dtypes'][0]}"
    if entry.get("reduce_op"):
        text += f" {entry['reduce_op']}"
    if entry["root_or_peer"] >= 0:
        text += f" {'peer' if entry['is_p2p'] else 'root'} {entry['root_or_peer']}"
    if entry["issued_by"] != "caller":
        text += " (issued by a callback)"
    return text


def _agreed(entry: dict) -> dict:
    """What every rank's call at one sequence number must share, as the runtime compares it in
    every message: never the shapes, which differ by design (gather's and scatter's lists,
    all_to_all's splits)."""
    fields = {"call": entry["profiling_name"], "dtype": entry["input_dtypes"][0], "root": entry["root_or_peer"],
              "issuer": entry["issued_by"]}
    if "reduce_op" in entry:
        fields["reduction"] = entry["reduce_op"]
    if "agreed_bytes" in entry:
        fields["agreed bytes"] = entry["agreed_bytes"]
    elif _collective(entry) in _SAME_SIZE:
        fields["elements"] = sum(math.prod(shape) for shape in entry["input_sizes"])
    return fields


def _differences(a: dict, b: dict) -> list[str]:
    return [field for field in a if field in b and a[field] != b[field]]


def _mismatches(collectives: dict[int, dict[int, dict]]) -> list[dict]:
    found = []
    for seq in sorted({s for c in collectives.values() for s in c}):
        kinds: list[dict] = []  # {"fields", "ranks", "entry"}, the first rank's call first
        for r in sorted(collectives):
            entry = collectives[r].get(seq)
            if entry is None:
                continue
            fields = _agreed(entry)
            kind = next((k for k in kinds if not _differences(k["fields"], fields)), None)
            if kind is None:
                kinds.append({"fields": fields, "ranks": [r], "entry": entry})
            else:
                kind["ranks"].append(r)
        if len(kinds) > 1:
            differ = sorted({f for k in kinds[1:] for f in _differences(kinds[0]["fields"], k["fields"])})
            found.append({"seq": seq, "differ": {f: [k["fields"][f] for k in kinds] for f in differ},
                          "calls": [{"ranks": k["ranks"], "call": _signature(k["entry"])} for k in kinds]})
    return found


def _where(dump: dict) -> dict:
    """The call a rank is in: its newest started or failed call, else its newest call."""
    entries = [e for e in dump["entries"] if e["state"] != "scheduled"]
    busy = [e for e in entries if e["state"] in ("started", "failed")]
    entry = max(busy or entries, key=lambda e: e["record_id"]) if entries else None
    return {
        "dump_reason": dump["dump_reason"],
        "seq": entry["collective_seq_id"] if entry else 0,
        "p2p_seq": entry["p2p_seq_id"] if entry else 0,
        "call": _signature(entry) if entry else None,
        "state": entry["state"] if entry else None,
        "waiting_for": entry["waiting_for"] if entry else "",
        "error": entry["error"] if entry else "",
        "queued": len(dump["entries"]) - len(entries),
        "python_stacks": python_stacks(dump.get("python_stacks")),
    }


def _gave_up(entry: dict, dump: dict) -> int | None:
    """When a rank gave up on a collective: when it failed, or when it wrote its dump on a failure
    while still in it (the recorder writes the dump before it marks the call failed)."""
    if entry["state"] == "failed":
        return entry["time_discovered_completed_ns"] or dump["time_dumped_ns"]
    if entry["state"] == "started" and dump["dump_reason"] != _REQUESTED:
        return dump["time_dumped_ns"]
    return None


def _primary(dumps: dict[int, dict], collectives: dict[int, dict[int, dict]], reached: dict[int, int],
             no_dump: list[int], newest: int) -> dict | None:
    """The earliest collective some rank gave up on, never reached, or is still in while another
    rank has gone past it (or, with ranks that wrote no dump, is still in): who never reached it,
    who gave up on it, and who came to it only after another rank had given up on it."""
    gave_up = {r: {s: t for s, e in c.items() if (t := _gave_up(e, dumps[r])) is not None}
               for r, c in collectives.items()}
    unreached = [reached[r] + 1 for r in reached if reached[r] < newest]
    stuck = [s for r, c in collectives.items() for s, e in c.items() if e["state"] == "started"
             and (no_dump or any(reached[other] > s for other in reached if other != r))]
    seq = min([s for g in gave_up.values() for s in g] + unreached + stuck, default=None)
    if seq is None:
        return None
    at = {r: c[seq] for r, c in sorted(collectives.items()) if seq in c}
    starts = {r: e["time_discovered_started_ns"] for r, e in at.items() if e["time_discovered_started_ns"] is not None}
    late = []
    for r, start in starts.items():
        before = [g[seq] for other, g in gave_up.items() if other != r and seq in g and g[seq] < start]
        if before:
            late.append({"rank": r, "after_ms": (start - min(starts.values())) / 1e6,
                         "after_given_up_ms": (start - min(before)) / 1e6})
    return {"seq": seq, "call": _signature(next(iter(at.values()))) if at else None,
            "reached": sorted(r for r in reached if reached[r] >= seq),
            "never": sorted(r for r in reached if reached[r] < seq),
            "gave_up": [{"rank": r, "state": e["state"], "error": e["error"] or e["waiting_for"]}
                        for r, e in at.items() if seq in gave_up[r]],
            "still_in": [r for r, e in at.items() if e["state"] == "started" and seq not in gave_up[r]],
            "late": late, "consequences": sorted({s for c in collectives.values() for s in c if s > seq})}


def _slowest(collectives: dict[int, dict[int, dict]]) -> list[dict]:
    slowest = []
    complete = [s for s in sorted({s for c in collectives.values() for s in c})
                if all(s in c for c in collectives.values())][-_LAST:]
    for seq in complete:
        starts = {r: c[seq]["time_discovered_started_ns"] for r, c in collectives.items()
                  if c[seq]["time_discovered_started_ns"] is not None}
        if len(starts) > 1:
            last = max(starts, key=starts.get)
            slowest.append({"seq": seq, "rank": last, "after_ms": (starts[last] - min(starts.values())) / 1e6})
    return slowest


def _failed_p2p(dumps: dict[int, dict]) -> list[dict]:
    """Each rank's first failed send or receive."""
    found = []
    for r, dump in sorted(dumps.items()):
        failed = [e for e in dump["entries"] if e["is_p2p"] and e["state"] == "failed"]
        if failed:
            entry = min(failed, key=lambda e: e["record_id"])
            found.append({"rank": r, "p2p_seq": entry["p2p_seq_id"], "call": _signature(entry),
                          "error": entry["error"]})
    return found


def _ranks_text(ranks) -> str:
    return describe_ranks(ranks) if ranks else "no rank"


def _primary_text(p: dict, no_dump: list[int]) -> str:
    text = f"collective #{p['seq']}" + (f" ({p['call']})" if p["call"] else "") + ": "
    never = p["never"] + no_dump
    parts = []
    if never:
        parts.append(f"{_ranks_text(p['reached'])} reached it; {describe_ranks(never)} never did"
                     + (f" ({describe_ranks(no_dump)} wrote no dump)" if no_dump else ""))
    if p["still_in"]:
        parts.append(f"{describe_ranks(p['still_in'])} still in it when {'it' if len(p['still_in']) == 1 else 'they'}"
                     " dumped")
    for late in p["late"]:
        parts.append(f"rank {late['rank']} came late, {late['after_ms']:.1f} ms after the first rank and "
                     f"{late['after_given_up_ms']:.1f} ms after another had given up on it")
    if p["gave_up"]:
        errors = {g["error"] for g in p["gave_up"]}
        parts.append(f"{describe_ranks([g['rank'] for g in p['gave_up']])} gave up on it"
                     + (f": {errors.pop()}" if len(errors) == 1 and "" not in errors else " (errors above)"))
    if p["consequences"]:
        seqs = p["consequences"]
        parts.append(f"later collectives (#{seqs[0]}" + (f"-#{seqs[-1]}" if len(seqs) > 1 else "")
                     + ") are its consequences")
    return text + "; ".join(parts)


def analyze(dumps: dict[int, dict]) -> dict:
    """What the dumps (as `load` returns them) say: {"world_size", "group", "ranks": {rank: where
    it is}, "outside": ranks whose dump is not of the group's ranks, "no_dump", "missing": the
    ranks that never reached the primary collective or wrote no dump, "newest": k, "primary": the
    primary cause or None, "mismatches", "failed_p2p", "slowest", "problems": [...]}."""
    if not dumps:
        raise ValueError("no rank<r>.json dumps")
    first = dumps[min(dumps)]
    size = first["world_size"]
    outside = sorted(r for r in dumps if r >= size)
    inside = {r: d for r, d in dumps.items() if r < size}
    collectives = {r: {e["collective_seq_id"]: e for e in d["entries"]
                       if not e["is_p2p"] and e["collective_seq_id"] > 0}
                   for r, d in inside.items()}
    # Sequence numbers are taken in order: a rank reached every collective up to its newest, even
    # those its buffer no longer holds.
    reached = {r: max(c, default=0) for r, c in collectives.items()}
    newest = max(reached.values(), default=0)
    no_dump = [r for r in range(size) if r not in inside]
    primary = _primary(inside, collectives, reached, no_dump, newest)
    mismatches = _mismatches(collectives)
    failed_p2p = _failed_p2p(inside)
    problems = []
    if primary:
        problems.append(_primary_text(primary, no_dump))
    elif no_dump:
        problems.append(f"{describe_ranks(no_dump)} wrote no dump")
    for m in mismatches:
        differ = "; ".join(f"{f} {' against '.join(map(str, values))}" for f, values in m["differ"].items())
        problems.append(f"collective #{m['seq']}: ranks called different collectives ({differ}): " +
                        "; ".join(f"{describe_ranks(c['ranks'])} called {c['call']}" for c in m["calls"]))
    if not primary:
        for f in failed_p2p:
            problems.append(f"rank {f['rank']}: {f['call']} (p2p #{f['p2p_seq']}) failed: {f['error']}")
    for r in outside:
        problems.append(f"rank{r}.json is from rank {r}, outside the group's {size} ranks "
                        f"({'0' if size == 1 else f'0-{size - 1}'}): left out")
    missing = sorted(set(primary["never"]) | set(no_dump)) if primary else no_dump
    return {"world_size": size, "group": first["pg_id"], "ranks": {r: _where(d) for r, d in inside.items()},
            "outside": outside, "missing": missing, "no_dump": no_dump, "newest": newest, "primary": primary,
            "mismatches": mismatches, "failed_p2p": failed_p2p, "slowest": _slowest(collectives),
            "problems": problems}


def _stack_lines(rank: int, where: dict) -> list[str]:
    threads = where["python_stacks"]
    if not threads:
        return [f"  rank {rank}'s dump holds no Python stacks"]
    lines = [f"  rank {rank}'s Python when it dumped (innermost frame first):"]
    idle = 0
    for thread in threads:
        if thread["idle"] and not thread["main"]:
            idle += 1
            continue
        label = "main thread" if thread["main"] else f"thread {thread['thread']}"
        lines.append(f"    {label}" + (" (wrote the dump)" if thread["current"] else "") + ":")
        lines += [f"      {frame}" for frame in thread["frames"][:_FRAMES]]
        if len(thread["frames"]) > _FRAMES:
            lines.append(f"      ... {len(thread['frames']) - _FRAMES} outer frames")
    if idle:
        lines.append(f"    ({idle} idle thread{'s' if idle > 1 else ''})")
    return lines


def _no_dump_line(lo: int, hi: int) -> str:
    """Ranks lo..hi-1 without a dump, in one line however many there are."""
    return f"  {describe_ranks(range(lo, hi)) if hi - lo < 3 else f'ranks {lo}-{hi - 1}'}: no dump"


def _rank_line(r: int, where: dict) -> str:
    if where["call"] is None:
        line = f"  rank {r}: no call recorded"
    else:
        seq = f"#{where['seq']}" if where["seq"] else (f"p2p #{where['p2p_seq']}" if where["p2p_seq"] else "queued")
        line = f"  rank {r}: {seq} {where['call']} ({where['state']})"
    if where["waiting_for"]:
        line += f"; waiting: {where['waiting_for']}"
    if where["error"]:
        line += f"; error: {where['error']}"
    if where["queued"]:
        line += f"; {where['queued']} more queued"
    return line + f" [dumped: {where['dump_reason']}]"


def report(found: dict) -> str:
    lines = [f"group '{found['group']}', {found['world_size']} ranks; newest collective #{found['newest']}"]
    ranks = {int(r): where for r, where in found["ranks"].items()}
    next_rank = 0
    for r in sorted(ranks):
        if r > next_rank:
            lines.append(_no_dump_line(next_rank, r))
        lines.append(_rank_line(r, ranks[r]))
        next_rank = r + 1
    if next_rank < found["world_size"]:
        lines.append(_no_dump_line(next_rank, found["world_size"]))
    for s in found["slowest"]:
        lines.append(f"  #{s['seq']}: rank {s['rank']} arrived last, {s['after_ms']:.3f} ms after the first")
    lines += [f"PROBLEM: {p}" for p in found["problems"]] or ["no rank missing, late or failed, no mismatch"]
    primary = found["primary"]
    if primary:
        behind = set(primary["never"]) | set(primary["still_in"]) | {late["rank"] for late in primary["late"]}
        for r in sorted(behind):
            lines += _stack_lines(r, ranks[r])
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_torus.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="a group's dump directory (the one its errors name)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    args = parser.parse_args(argv)
    try:
        found = analyze(load(args.directory))
    except DumpError as error:
        print(f"torch_torus.trace: cannot read the dumps: {error}", file=sys.stderr)
        return 2
    print(json.dumps(found, indent=2) if args.json else report(found))
    return 1 if found["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
