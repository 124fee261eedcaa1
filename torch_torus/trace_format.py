"""Reading the flight recorder's dumps (csrc/backend/flight_recorder.cc writes them): every field
checked before the analyzer (torch_torus/trace.py) looks at it, so that a damaged, truncated or
foreign file is named with the field at fault instead of failing somewhere inside the analysis,
and nothing is allocated by what a file claims (a world size, a sequence number) rather than by
what it holds."""

from __future__ import annotations

import json
import os
import re

DUMP_NAME = re.compile(r"rank(\d+)\.json")
VERSION = "torus-1"
# More ranks than any job runs: a world_size above it is a damaged field, and the ranks that wrote
# no dump are counted up to it.
MAX_WORLD_SIZE = 1 << 20
STATES = ("scheduled", "started", "completed", "failed")
ISSUERS = ("caller", "callback")


class DumpError(ValueError):
    """A dump that cannot be read: the message names the file and the field."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(where: str, record: dict, field: str, valid, expected: str, optional: bool = False):
    """record[field] when `valid` accepts it; else a DumpError naming `where` and the field."""
    if field not in record:
        if optional:
            return None
        raise DumpError(f"{where}: no field '{field}' ({expected})")
    value = record[field]
    if not valid(value):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 60 else shown[:55] + "..."
        raise DumpError(f"{where}: field '{field}' is {shown}, not {expected}")
    return value


def _count(value) -> bool:
    return _is_int(value) and value >= 0


def _time(value) -> bool:
    return value is None or _count(value)


def _text(value) -> bool:
    return isinstance(value, str)


def _shapes(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(shape, list) and all(_count(d) for d in shape) for shape in value)


def _dtypes(value) -> bool:
    return isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and value[0] != ""


# Every field of an entry: its test, what it must be, and whether dumps written before it existed
# lack it.
_ENTRY_FIELDS = (
    ("record_id", _count, "a count", False),
    ("pg_id", _text, "text", False),
    ("collective_seq_id", _count, "a sequence number (0 or more)", False),
    ("p2p_seq_id", _count, "a sequence number (0 or more)", False),
    ("profiling_name", lambda v: isinstance(v, str) and v != "", "a call's name", False),
    ("is_p2p", lambda v: isinstance(v, bool), "true or false", False),
    ("input_sizes", _shapes, "a list of shapes", False),
    ("output_sizes", _shapes, "a list of shapes", False),
    ("input_dtypes", _dtypes, "a list of one dtype", False),
    ("output_dtypes", _dtypes, "a list of one dtype", False),
    ("root_or_peer", lambda v: _is_int(v) and v >= -1, "a rank or -1", False),
    ("issued_by", lambda v: v in ISSUERS, " or ".join(ISSUERS), False),
    ("state", lambda v: v in STATES, ", ".join(STATES), False),
    ("time_created_ns", _count, "a time in ns", False),
    ("time_discovered_started_ns", _time, "a time in ns or null", False),
    ("time_discovered_completed_ns", _time, "a time in ns or null", False),
    ("error", _text, "text", False),
    ("waiting_for", _text, "text", False),
    ("reduce_op", lambda v: v is None or (isinstance(v, str) and v != ""), "a reduction's name or null", True),
    ("agreed_bytes", _count, "a byte count", True),
)


def _entry(where: str, entry) -> dict:
    if not isinstance(entry, dict):
        raise DumpError(f"{where}: not an object")
    for field, valid, expected, optional in _ENTRY_FIELDS:
        _check(where, entry, field, valid, expected, optional)
    other = "collective_seq_id" if entry["is_p2p"] else "p2p_seq_id"
    if entry[other] != 0:
        raise DumpError(f"{where}: field '{other}' is {entry[other]} in a{' p2p' if entry['is_p2p'] else ' collective'}"
                        " entry, where it is 0")
    if entry["state"] == "failed" and not entry["error"]:
        raise DumpError(f"{where}: field 'error' is empty in a failed entry")
    return entry


def read_dump(path: str, rank: int) -> dict:
    """One rank's dump, every field checked; DumpError names the file and the field at fault."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise DumpError(f"{path}: cannot be read ({error.strerror or error})") from None
    try:
        dump = json.loads(raw)
    except UnicodeDecodeError as error:
        raise DumpError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        end = "" if error.pos == 0 or raw.rstrip().endswith(b"}") else " (the file does not end with '}': cut short?)"
        raise DumpError(f"{path}: not JSON: {error.msg} at line {error.lineno} column {error.colno}{end}") from None
    except RecursionError:
        raise DumpError(f"{path}: not a dump: JSON nested too deep") from None
    if not isinstance(dump, dict):
        raise DumpError(f"{path}: not a dump: a JSON {type(dump).__name__}, not an object with 'version' and 'entries'")
    _check(path, dump, "version", lambda v: v == VERSION, json.dumps(VERSION))
    _check(path, dump, "pg_id", _text, "a group's name")
    _check(path, dump, "rank", lambda v: v == rank, f"{rank} (the rank its name {name} says)")
    _check(path, dump, "world_size", lambda v: _is_int(v) and 1 <= v <= MAX_WORLD_SIZE,
           f"a group size (1 to {MAX_WORLD_SIZE})")
    _check(path, dump, "dump_reason", _text, "text")
    _check(path, dump, "time_dumped_ns", _count, "a time in ns")
    _check(path, dump, "python_stacks", lambda v: v is None or isinstance(v, str), "text or null", optional=True)
    entries = _check(path, dump, "entries", lambda v: isinstance(v, list), "a list of entries")
    seen = {}
    for i, entry in enumerate(entries):
        _entry(f"{path}: entries[{i}]", entry)
        seq = entry["collective_seq_id"]
        if seq and not entry["is_p2p"]:
            if seq in seen:
                raise DumpError(f"{path}: entries[{i}]: field 'collective_seq_id' is {seq}, "
                                f"as is entries[{seen[seq]}]'s")
            seen[seq] = i
    return dump


def load(directory: str) -> dict[int, dict]:
    """Every rank's dump in `directory`, by rank, every field checked (DumpError otherwise); the
    dumps must be of one group (its name and size)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as error:
        raise DumpError(f"{directory}: cannot be read ({error.strerror or error})") from None
    dumps = {}
    for name in names:
        match = DUMP_NAME.fullmatch(name)
        if match:
            rank = int(match.group(1))
            if str(rank) != match.group(1):
                raise DumpError(f"{os.path.join(directory, name)}: not a dump's name "
                                "(rank<r>.json, r without leading zeros)")
            dumps[rank] = read_dump(os.path.join(directory, name), rank)
    if not dumps:
        raise DumpError(f"{directory}: no rank<r>.json dumps")
    first = min(dumps)
    for field in ("pg_id", "world_size"):
        for rank, dump in sorted(dumps.items()):
            if dump[field] != dumps[first][field]:
                raise DumpError(f"{os.path.join(directory, f'rank{rank}.json')}: field '{field}' is "
                                f"{json.dumps(dump[field])}, but rank{first}.json's is "
                                f"{json.dumps(dumps[first][field])}: dumps of different groups in one directory?")
    return dumps


_THREAD = re.compile(r"(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(.*)\])? \(most recent call first\):")
_FRAME = re.compile(r'\s*File "(.*)", line (\S+) in (.*)')
# Where a thread with nothing to do waits: its innermost frame in one of these.
_IDLE = re.compile(r"(threading|queue|selectors|socket|multiprocessing/connection|concurrent/futures/thread)\.py$")


def python_stacks(text: str | None) -> list[dict]:
    """A faulthandler dump's threads, as written (the main thread, the oldest, last): each with
    "thread" (its id), "current" (it wrote the dump), "main", "idle" (waits in threading, queue,
    selectors...) and "frames", innermost first ("file:line in function")."""
    threads: list[dict] = []
    for line in (text or "").splitlines():
        header = _THREAD.fullmatch(line.strip())
        if header:
            threads.append({"thread": header.group(2), "current": header.group(1) == "Current thread",
                            "frames": [], "files": []})
            continue
        if not threads or not line.strip():
            continue
        frame = _FRAME.fullmatch(line)
        threads[-1]["frames"].append(
            f"{frame.group(1)}:{frame.group(2)} in {frame.group(3)}" if frame else line.strip())
        threads[-1]["files"].append(frame.group(1) if frame else "")
    for thread in threads:
        files = thread.pop("files")
        thread["idle"] = bool(files) and bool(_IDLE.search(files[0]))
        # A thread threading started has threading's _bootstrap outermost; the main thread does not.
        thread["main"] = not (files and files[-1].endswith("threading.py"))
    mains = [t for t in threads if t["main"]]
    for thread in mains[:-1]:
        thread["main"] = False
    return threads
