"""python -m torch_torus.trace DIR: where every rank was when a group hung or failed.

Each rank's flight recorder (TORUS_TRACE_BUFFER) keeps the group's last collectives and
point-to-point calls, and writes them to DIR/rank<r>.json when a collective times out or fails,
when the group is aborted, or on torch_torus.dump_trace(). This reads every rank's file and says
which collective each rank is in, which ranks never reached the newest one (or wrote no dump),
which ranks ran different collectives at one sequence number (both signatures), and which rank
arrived last at each of the last collectives. Exits 1 when it finds a rank missing or a
mismatch, 0 otherwise; --json prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

from .agreement import describe_ranks

_DUMP = re.compile(r"rank(\d+)\.json$")
# The last collectives whose latest arrival the report names.
_LAST = 5


def trace_directory(base: str, group: str, epoch: str) -> str:
    """The directory of one group's dumps: TORUS_TRACE_DIR (default: torus-trace-<uid> in the
    temporary directory, one per user) / <group name>-<epoch>."""
    base = base or os.path.join(tempfile.gettempdir(), f"torus-trace-{os.getuid()}")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", group) or "group"
    return os.path.join(base, f"{name}-{epoch}")


def load(directory: str) -> dict[int, dict]:
    """Every rank's dump in `directory`, by rank."""
    dumps = {}
    for entry in sorted(os.listdir(directory)):
        match = _DUMP.fullmatch(entry)
        if match:
            with open(os.path.join(directory, entry)) as f:
                dumps[int(match.group(1))] = json.load(f)
    return dumps


def _signature(entry: dict) -> str:
    text = f"{entry['profiling_name']} of {entry['input_sizes']} -> {entry['output_sizes']} {entry['input_dtypes'][0]}"
    if entry["root_or_peer"] >= 0:
        text += f" root {entry['root_or_peer']}"
    if entry["issued_by"] != "caller":
        text += " (issued by a callback)"
    return text


def analyze(dumps: dict[int, dict]) -> dict:
    """What the dumps say: {"world_size", "group", "ranks": {rank: where it is}, "missing": [...],
    "newest": k, "mismatches": [...], "slowest": [...], "problems": [...]}."""
    if not dumps:
        raise ValueError("no rank<r>.json dumps")
    size = max(d["world_size"] for d in dumps.values())
    collectives = {r: {e["collective_seq_id"]: e for e in d["entries"]
                       if not e["is_p2p"] and e["collective_seq_id"] > 0}
                   for r, d in dumps.items()}
    newest = max((max(c) for c in collectives.values() if c), default=0)
    ranks = {}
    for r, by_seq in collectives.items():
        running = [e for e in by_seq.values() if e["state"] == "started"]
        failed = [e for e in by_seq.values() if e["state"] == "failed"]
        last = by_seq[max(by_seq)] if by_seq else None
        here = (running or failed or ([last] if last else []))
        entry = here[-1] if here else None
        ranks[r] = {
            "dump_reason": dumps[r]["dump_reason"],
            "seq": entry["collective_seq_id"] if entry else 0,
            "call": _signature(entry) if entry else None,
            "state": entry["state"] if entry else None,
            "waiting_for": entry["waiting_for"] if entry else "",
            "error": entry["error"] if entry else "",
        }
    no_dump = [r for r in range(size) if r not in dumps]
    behind = [r for r, by_seq in collectives.items() if (max(by_seq) if by_seq else 0) < newest]
    mismatches = []
    for seq in sorted({s for c in collectives.values() for s in c}):
        calls = {}
        for r, by_seq in collectives.items():
            if seq in by_seq:
                calls.setdefault(_signature(by_seq[seq]), []).append(r)
        if len(calls) > 1:
            mismatches.append({"seq": seq, "calls": [{"ranks": rs, "call": c} for c, rs in calls.items()]})
    slowest = []
    complete = [s for s in sorted({s for c in collectives.values() for s in c})
                if all(s in c for c in collectives.values())][-_LAST:]
    for seq in complete:
        starts = {r: c[seq]["time_discovered_started_ns"] for r, c in collectives.items()
                  if c[seq]["time_discovered_started_ns"] is not None}
        if len(starts) > 1:
            last = max(starts, key=starts.get)
            slowest.append({"seq": seq, "rank": last, "after_ms": (starts[last] - min(starts.values())) / 1e6})
    problems = []
    if no_dump or behind:
        what = collectives[next(r for r in collectives if newest in collectives[r])][newest]
        reached = set(collectives) - set(behind)
        problems.append(f"collective #{newest} ({_signature(what)}): {describe_ranks(reached)} reached it; "
                        f"{describe_ranks(set(behind) | set(no_dump))} never did"
                        + (f" ({describe_ranks(no_dump)} wrote no dump)" if no_dump else ""))
    for m in mismatches:
        problems.append(f"collective #{m['seq']}: ranks called different collectives: " +
                        "; ".join(f"{describe_ranks(c['ranks'])} called {c['call']}" for c in m["calls"]))
    return {"world_size": size, "group": next(iter(dumps.values()))["pg_id"], "ranks": ranks,
            "missing": sorted(set(behind) | set(no_dump)), "no_dump": no_dump, "newest": newest,
            "mismatches": mismatches, "slowest": slowest, "problems": problems}


def report(found: dict) -> str:
    lines = [f"group '{found['group']}', {found['world_size']} ranks; newest collective #{found['newest']}"]
    for r in range(found["world_size"]):
        where = found["ranks"].get(r)
        if where is None:
            lines.append(f"  rank {r}: no dump")
            continue
        line = f"  rank {r}: #{where['seq']} {where['call']} ({where['state']})"
        if where["waiting_for"]:
            line += f"; waiting: {where['waiting_for']}"
        if where["error"]:
            line += f"; error: {where['error']}"
        lines.append(line + f" [dumped: {where['dump_reason']}]")
    for s in found["slowest"]:
        lines.append(f"  #{s['seq']}: rank {s['rank']} arrived last, {s['after_ms']:.3f} ms after the first")
    lines += [f"PROBLEM: {p}" for p in found["problems"]] or ["no rank missing, no mismatch"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_torus.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="a group's dump directory (the one its errors name)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    args = parser.parse_args(argv)
    try:
        found = analyze(load(args.directory))
    except (OSError, ValueError, KeyError) as error:
        print(f"torch_torus.trace: cannot read the dumps in {args.directory}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(found, indent=2) if args.json else report(found))
    return 1 if found["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
