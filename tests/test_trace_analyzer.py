"""The flight recorder's analyzer, `python -m torch_torus.trace` (issue 53): right on what it reads.

Recorded histories of every collective torus runs, in every algorithm of the catalog, with sizes
that differ by rank wherever torch allows, at 2 and 3 ranks: no mismatch, no problem, exit 0.
Synthetic dumps (the recorder's format): real mismatches named with both calls (collective,
algorithm, dtype, reduction, root, agreed size, issuer); a rank late to a collective named as the
primary cause, the collective after it a consequence; a group that only sends and receives;
damaged files (exit 2, the file and the field named, no traceback); a dump from a rank outside
the group; a stuck rank's Python stack.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import resource
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import harness
from torch_torus import algorithms, trace
from torch_torus.trace_format import MAX_WORLD_SIZE, python_stacks

_T0 = 1_700_000_000_000_000_000


# The address space the analyzer runs in where a file claims a huge group: importing torch fits;
# a list of the ranks of the claimed group would not.
_ADDRESS_SPACE = 4 << 30


def _cli(directory, *flags, timeout=60, bounded=False):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))

    run = subprocess.run([sys.executable, "-m", "torch_torus.trace", *flags, str(directory)], capture_output=True,
                         text=True, timeout=timeout, preexec_fn=limit if bounded else None)
    return run.returncode, run.stdout, run.stderr


def _analyzed(directory):
    found = trace.analyze(trace.load(str(directory)))
    return found, trace.report(found)


# ------------------------------------------------------------------ recorded healthy histories


def _split(src, dst):
    return (src * 7 + dst * 3) % 4  # uneven, zeros included


def _every_collective(group, n, r):
    """Every collective and point-to-point call torch.distributed has that torus runs, sizes
    differing by rank wherever torch allows."""
    dist.all_reduce(torch.ones(7), group=group)
    dist.all_reduce(torch.ones(2, 3, dtype=torch.float64), op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(torch.ones(70000), group=group)
    indices = torch.tensor([list(range(r + 1))])
    dist.all_reduce(torch.sparse_coo_tensor(indices, torch.ones(r + 1), (8,)), group=group)
    dist.broadcast(torch.ones(5), src=n - 1, group=group)
    dist.reduce(torch.ones(6, dtype=torch.int32), dst=1, op=dist.ReduceOp.PRODUCT, group=group)
    dist.all_gather([torch.empty(4) for _ in range(n)], torch.ones(4), group=group)
    dist.all_gather_into_tensor(torch.empty(4 * n), torch.ones(4), group=group)
    dist.gather(torch.ones(4), [torch.empty(4) for _ in range(n)] if r == 0 else None, dst=0, group=group)
    dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(n)] if r == n - 1 else None, src=n - 1, group=group)
    dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(n)], group=group)
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n), op=dist.ReduceOp.MIN, group=group)
    dist.all_to_all([torch.empty(_split(i, r), 2) for i in range(n)],
                    [torch.ones(_split(r, j), 2) for j in range(n)], group=group)
    out_splits, in_splits = [_split(i, r) for i in range(n)], [_split(r, j) for j in range(n)]
    dist.all_to_all_single(torch.empty(sum(out_splits), 2), torch.ones(sum(in_splits), 2), out_splits, in_splits,
                           group=group)
    with dist._coalescing_manager(group=group, async_ops=True) as coalesced:
        for size in (3, 5):
            dist.all_gather_into_tensor(torch.empty(size * n), torch.ones(size), group=group, async_op=True)
    coalesced.wait()
    dist.barrier(group=group)
    work = dist.all_reduce(torch.ones(3), group=group, async_op=True)
    work.get_future().then(lambda _: dist.broadcast(torch.ones(2), src=0, group=group)).wait()
    # Point to point: sizes differ by sender.
    nxt, prv = (r + 1) % n, (r - 1) % n
    if r == 0:
        dist.send(torch.ones(r + 1), 1, group=group)
    elif r == 1:
        dist.recv(torch.empty(1), 0, group=group)
    sent = dist.isend(torch.ones(r + 2), nxt, group=group)
    dist.irecv(torch.empty(prv + 2), prv, group=group).wait()
    sent.wait()
    ops = [dist.P2POp(dist.isend, torch.ones(r + 3), nxt, group=group),
           dist.P2POp(dist.irecv, torch.empty(prv + 3), prv, group=group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    # The object collectives: objects of a size that differs by rank.
    mine = {"rank": r, "payload": "x" * (100 * r + 1)}
    dist.all_gather_object([None] * n, mine, group=group)
    dist.gather_object(mine, [None] * n if r == 0 else None, dst=0, group=group)
    dist.broadcast_object_list([mine, r] if r == 1 else [None, None], src=1, group=group)
    received = [None]
    dist.scatter_object_list(received, [{"to": j, "x": "y" * j * 50} for j in range(n)] if r == 0 else None, src=0,
                             group=group)
    dist.barrier(group=group)


def _case_every_collective(ctx):
    """Every collective on the default algorithms, then on each algorithm of the catalog (a group
    each); a dump of every group on every rank. Returns the dumps' paths."""
    ctx.init_process_group(init="file")
    import torch_torus

    def options(collective, name):
        # A grid of one row: the torus algorithm runs as itself at 2 and 3 ranks.
        grid = {"torus_dims": f"1x{ctx.world_size}"} if name in algorithms.NEEDS_GRID else {}
        return torch_torus.Options(**{collective: name}, **grid)

    groups = [ctx.new_group()] + [ctx.new_group(pg_options=options(collective, name))
                                  for collective, names in algorithms.CHOOSABLE.items() for name in names]
    paths = []
    for group in groups:
        _every_collective(group, ctx.world_size, ctx.rank)
        paths.append(torch_torus.dump_trace(group))
    return paths


def _shapes_differ(directory):
    """Whether some collective's shapes differ between ranks in these dumps."""
    dumps = trace.load(directory)
    by_seq = {}
    for dump in dumps.values():
        for e in dump["entries"]:
            if not e["is_p2p"] and e["collective_seq_id"]:
                by_seq.setdefault(e["collective_seq_id"], set()).add(json.dumps([e["input_sizes"], e["output_sizes"]]))
    return any(len(shapes) > 1 for shapes in by_seq.values())


@pytest.mark.parametrize("world_size", [2, 3])
def test_healthy_history_of_every_collective(tmp_path, world_size):
    results = harness.run_job("torus", world_size, _case_every_collective, env={"TORUS_TRACE_DIR": str(tmp_path)},
                              timeout=240)
    directories = sorted({os.path.dirname(p) for paths in results for p in paths})
    assert len(directories) == len(results[0]) and all(len(p) == len(results[0]) for p in results), results
    names = set()
    for directory in directories:
        assert sorted(os.listdir(directory)) == [f"rank{r}.json" for r in range(world_size)], directory
        found, text = _analyzed(directory)
        assert not found["problems"] and not found["mismatches"] and not found["missing"], text
        assert found["newest"] >= 20 and text.endswith("no rank missing, late or failed, no mismatch"), text
        assert _shapes_differ(directory), f"{directory}: no collective whose shapes differ by rank"
        names |= {e["profiling_name"] for dump in trace.load(directory).values() for e in dump["entries"]}
    # Every algorithm of the catalog ran (the catalog's collective names as torch.distributed's).
    for collective, catalog in algorithms.CHOOSABLE.items():
        call = {"allreduce": "all_reduce", "allgather": "all_gather"}.get(collective, collective)
        ran = {name.split(":")[2] for name in names if name.startswith(f"torus:{call}:")}
        assert ran == set(catalog), f"{call} algorithms that ran: {sorted(ran)}, the catalog's: {catalog}"
    code, out, err = _cli(directories[0])
    assert code == 0 and "no rank missing" in out and not err, (code, out, err)
    code, out, err = _cli(directories[0], "--json")
    found = json.loads(out)
    assert code == 0 and found["missing"] == [] and found["mismatches"] == [] and found["newest"] >= 20, out


# ------------------------------------------------------------------ synthetic dumps


def _entry(seq, name="torus:all_reduce:ring", *, state="completed", start_s=None, end_s=None, sizes=((4,),),
           out=None, dtype="Float", op="SUM", root=-1, agreed=16, issued_by="caller", error="", waiting="",
           p2p=False):
    start = _T0 + int((seq if start_s is None else start_s) * 1e9)
    end = None if state == "started" else (start + 1_000_000 if end_s is None else _T0 + int(end_s * 1e9))
    sizes = [list(s) for s in sizes]
    return {"record_id": 0, "pg_id": "0", "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0,
            "profiling_name": name, "is_p2p": p2p, "input_sizes": sizes,
            "output_sizes": sizes if out is None else [list(s) for s in out], "input_dtypes": [dtype],
            "output_dtypes": [dtype], "root_or_peer": root, "issued_by": issued_by, "state": state,
            "time_created_ns": start, "time_discovered_started_ns": start, "time_discovered_completed_ns": end,
            "error": error, "waiting_for": waiting, "reduce_op": op, "agreed_bytes": agreed}


def _dump(rank, size, entries, reason="requested", stacks=None, dumped_s=100):
    entries = copy.deepcopy(entries)
    for i, e in enumerate(entries):
        e["record_id"] = i + 1
    return {"version": "torus-1", "pg_id": "0", "rank": rank, "world_size": size, "dump_reason": reason,
            "time_dumped_ns": _T0 + int(dumped_s * 1e9), "entries": entries, "python_stacks": stacks}


def _write(directory, *dumps):
    for dump in dumps:
        with open(os.path.join(directory, f"rank{dump['rank']}.json"), "w") as f:
            json.dump(dump, f)
    return directory


# Two calls that differ in one thing every rank must agree on, field by field.
_MISMATCHES = {
    "collective": ({}, {"name": "torus:broadcast:binomial", "op": None, "root": 0}),
    "algorithm": ({}, {"name": "torus:all_reduce:direct"}),
    "dtype": ({}, {"dtype": "Double", "agreed": 32}),
    "reduction": ({}, {"op": "MAX"}),
    "root": ({"name": "torus:gather", "op": None, "root": 0, "agreed": 16}, {"name": "torus:gather", "op": None,
                                                                              "root": 1, "agreed": 16}),
    "agreed bytes": ({"sizes": [(4,)]}, {"sizes": [(8,)], "agreed": 32}),
    "issuer": ({}, {"issued_by": "callback"}),
}


@pytest.mark.parametrize("what", list(_MISMATCHES))
def test_mismatch_named_with_both_calls(tmp_path, what):
    mine, theirs = _MISMATCHES[what]
    first = [_entry(1), _entry(2, **mine)]
    second = [_entry(1), _entry(2, **theirs)]
    found, text = _analyzed(_write(tmp_path, _dump(0, 2, first), _dump(1, 2, second)))
    (mismatch,) = found["mismatches"]
    assert mismatch["seq"] == 2, mismatch
    calls = {tuple(c["ranks"]): c["call"] for c in mismatch["calls"]}
    assert calls == {(0,): trace._signature(first[1]), (1,): trace._signature(second[1])}, calls
    line = next(p for p in found["problems"] if p.startswith("collective #2: ranks called different collectives"))
    assert f"rank 0 called {calls[(0,)]}" in line and f"rank 1 called {calls[(1,)]}" in line, line
    assert found["primary"] is None and f"PROBLEM: {line}" in text, text


def test_mismatch_exits_1(tmp_path):
    _write(tmp_path, _dump(0, 2, [_entry(1, dtype="Float")]), _dump(1, 2, [_entry(1, dtype="Half", agreed=8)]))
    code, out, err = _cli(tmp_path)
    assert code == 1 and "dtype Float against Half" in out and not err, (code, out, err)


# Shapes that differ between correct ranks, as the issue reported them: never a mismatch.
_BY_DESIGN = {
    "gather": ({"name": "torus:gather:direct", "op": None, "root": 0, "out": [(4,), (4,)]},
               {"name": "torus:gather:direct", "op": None, "root": 0, "out": []}),
    "scatter": ({"name": "torus:scatter:direct", "op": None, "root": 1, "sizes": [], "out": [(3,)]},
                {"name": "torus:scatter:direct", "op": None, "root": 1, "sizes": [(3,), (3,)], "out": [(3,)]}),
    "all_to_all_single": ({"name": "torus:all_to_all_single:pairwise", "op": None, "agreed": 0, "sizes": [(5, 2)],
                           "out": [(2, 2)]},
                          {"name": "torus:all_to_all_single:pairwise", "op": None, "agreed": 0, "sizes": [(2, 2)],
                           "out": [(5, 2)]}),
}


@pytest.mark.parametrize("what", list(_BY_DESIGN))
def test_shapes_differing_by_design_are_no_mismatch(tmp_path, what):
    mine, theirs = _BY_DESIGN[what]
    _write(tmp_path, _dump(0, 2, [_entry(1), _entry(2, **mine)]), _dump(1, 2, [_entry(1), _entry(2, **theirs)]))
    code, out, err = _cli(tmp_path)
    assert code == 0 and out.rstrip().endswith("no rank missing, late or failed, no mismatch"), (code, out, err)


def test_dumps_without_agreed_bytes(tmp_path):
    """Dumps written before reduce_op and agreed_bytes: gather's lists still agree; an all_reduce
    of another element count is still a mismatch."""
    def old(entry):
        del entry["reduce_op"], entry["agreed_bytes"]
        return entry

    first = [old(_entry(1, "torus:gather", root=0, out=[(4,), (4,)])), old(_entry(2, sizes=[(4,)]))]
    second = [old(_entry(1, "torus:gather", root=0, out=[])), old(_entry(2, sizes=[(2, 4)]))]
    found, _ = _analyzed(_write(tmp_path, _dump(0, 2, first), _dump(1, 2, second)))
    assert [m["seq"] for m in found["mismatches"]] == [2] and found["mismatches"][0]["differ"] == {"elements": [4, 8]}


def _late_to_3(state):
    """Rank 2 comes to #3 8 s after ranks 0-1, who time out there after 5 s and dump, their #3
    `state` (the recorder writes a failure's dump while the call is still started); rank 2's #3
    then completes (it only sends) and its #4 fails, its peers having given up."""
    timed_out = "torus:broadcast:binomial #3 (rank {} of 3, group '0'): timed out waiting for receive of 16 bytes " \
                "from rank 2 (the timeout of 5000 ms expired); rank 2 had not reached #3"
    early = [_entry(1), _entry(2)]
    dumps = [_dump(r, 3, early + [_entry(3, name="torus:broadcast:binomial", op=None, root=2, state=state,
                                         start_s=10, end_s=15, error=timed_out.format(r) if state == "failed" else "",
                                         waiting="rank 2 had not reached #3" if state == "started" else "")],
                   "collective failed", dumped_s=15)
             for r in (0, 1)]
    dumps.append(_dump(2, 3, early + [
        _entry(3, name="torus:broadcast:binomial", op=None, root=2, start_s=18),
        _entry(4, state="failed", start_s=18.01, end_s=18.02,
               error="torus:all_reduce:ring #4 (rank 2 of 3, group '0'): rank 0 gave up on the group: ...")],
        "collective failed", dumped_s=18.02))
    return dumps


@pytest.mark.parametrize("state", ["failed", "started"])
def test_late_rank_is_the_primary_cause(tmp_path, state):
    found, text = _analyzed(_write(tmp_path, *_late_to_3(state)))
    primary = found["primary"]
    assert primary["seq"] == 3 and primary["never"] == [] and found["missing"] == [], primary
    (late,) = primary["late"]
    assert late["rank"] == 2 and late["after_ms"] == pytest.approx(8000) and \
        late["after_given_up_ms"] == pytest.approx(3000), late
    assert [g["rank"] for g in primary["gave_up"]] == [0, 1] and primary["consequences"] == [4], primary
    first = found["problems"][0]
    assert first.startswith("collective #3 (torus:broadcast:binomial") and \
        "rank 2 came late, 8000.0 ms after the first rank and 3000.0 ms after another had given up on it" in first \
        and "ranks 0-1 gave up on it" in first, first
    assert "later collectives (#4) are its consequences" in first, first
    # #4 is no one's fault: ranks 0-1 had given up before it.
    assert len(found["problems"]) == 1 and "never did" not in text and "#4:" not in text, text
    code, out, err = _cli(tmp_path)
    assert code == 1 and first in out and not err, (code, out, err)


def test_send_and_receive_only(tmp_path):
    # Both ranks, every call completed: nothing to report.
    calls = [_entry(1, "torus:send", p2p=True, op=None, root=1, agreed=0),
             _entry(2, "torus:recv", p2p=True, op=None, root=1, agreed=0)]
    both = tmp_path / "both"
    both.mkdir()
    _write(both, _dump(0, 2, calls), _dump(1, 2, [dict(e, root_or_peer=0) for e in calls]))
    code, out, err = _cli(both)
    assert code == 0 and "newest collective #0" in out and "rank 1: p2p #2 torus:recv" in out and not err, \
        (code, out, err)
    # Rank 0's receive timed out; rank 1 wrote nothing.
    error = "torus:recv #2 (rank 0 of 2, group '0'): timed out waiting for receive of 16 bytes from rank 1"
    one = tmp_path / "one"
    one.mkdir()
    _write(one, _dump(0, 2, calls[:1] + [_entry(2, "torus:recv", p2p=True, op=None, root=1, agreed=0, state="failed",
                                                 error=error)], "collective failed"))
    code, out, err = _cli(one)
    assert code == 1 and not err, (code, out, err)
    assert "PROBLEM: rank 1 wrote no dump" in out and f"PROBLEM: rank 0: torus:recv of [[4]] -> [[4]] Float peer 1 " \
        f"(p2p #2) failed: {error}" in out, out
    code, out, _ = _cli(one, "--json")
    found = json.loads(out)
    assert code == 1 and found["missing"] == [1] and found["newest"] == 0 and found["failed_p2p"][0]["rank"] == 0, out


def _valid_text():
    return json.dumps(_dump(0, 2, [_entry(1), _entry(2)]), indent=1)


def _with(change):
    dump = json.loads(_valid_text())
    change(dump)
    return json.dumps(dump)


# Damaged files: what rank0.json holds, and what the message must name.
_DAMAGED = {
    "not JSON": ("this is no dump\n", "not JSON"),
    "truncated": (_valid_text()[:300], "cut short"),
    "a JSON list": ("[1, 2]", "a JSON list"),
    "entries null": (_with(lambda d: d.update(entries=None)), "field 'entries' is null"),
    "null seq": (_with(lambda d: d["entries"][1].update(collective_seq_id=None)),
                 "entries[1]: field 'collective_seq_id' is null"),
    "empty dtypes": (_with(lambda d: d["entries"][0].update(input_dtypes=[])), "field 'input_dtypes' is []"),
    "huge world_size": (_with(lambda d: d.update(world_size=999999999)), "field 'world_size' is 999999999"),
    "missing state": (_with(lambda d: d["entries"][0].pop("state")), "entries[0]: no field 'state'"),
    "missing rank": (_with(lambda d: d.pop("rank")), "no field 'rank'"),
    "other version": (_with(lambda d: d.update(version="torus-9")), "field 'version' is \"torus-9\""),
    "string time": (_with(lambda d: d["entries"][1].update(time_created_ns="soon")), "field 'time_created_ns'"),
    "failed without error": (_with(lambda d: d["entries"][1].update(state="failed")), "field 'error' is empty"),
    "another group's size": (None, "field 'world_size' is 3, but rank0.json's is 2"),
}


@pytest.mark.parametrize("what", list(_DAMAGED))
def test_damaged_dump_is_named(tmp_path, what):
    text, named = _DAMAGED[what]
    if text is None:
        _write(tmp_path, _dump(0, 2, [_entry(1)]), _dump(1, 3, [_entry(1)]))
    else:
        (tmp_path / "rank0.json").write_text(text)
    started = time.monotonic()
    code, out, err = _cli(tmp_path, bounded=True)
    took = time.monotonic() - started
    assert code == 2 and out == "" and "Traceback" not in err, (code, out, err)
    assert err.startswith("torch_torus.trace: cannot read the dumps: ") and named in err, err
    assert ("rank1.json" if text is None else f"{tmp_path}/rank0.json") in err, err
    assert took < 60, f"took {took:.1f} s"  # a bound, not a measurement: the claimed world size allocates nothing


def test_largest_world_size_stays_bounded(tmp_path):
    """A lone dump of the largest group the format takes: every rank without a dump on one line."""
    _write(tmp_path, _dump(0, MAX_WORLD_SIZE, [_entry(1)]))
    code, out, err = _cli(tmp_path, bounded=True)
    assert code == 1 and f"  ranks 1-{MAX_WORLD_SIZE - 1}: no dump" in out and len(out) < 2000, (code, out[:2000], err)


def test_rank_outside_the_group(tmp_path):
    history = [_entry(1), _entry(2)]
    _write(tmp_path, _dump(0, 2, history), _dump(1, 2, history),
           _dump(5, 2, history + [_entry(3, state="started", waiting="rank 0 had not reached #3")]))
    found, text = _analyzed(tmp_path)
    assert found["outside"] == [5] and found["newest"] == 2 and found["primary"] is None, found
    assert sorted(found["ranks"]) == [0, 1] and found["missing"] == [], found
    assert found["problems"] == ["rank5.json is from rank 5, outside the group's 2 ranks (0-1): left out"], found
    assert "rank 5:" not in text and "reached" not in text, text
    code, _, _ = _cli(tmp_path)
    assert code == 1


def _stuck_stacks():
    """A faulthandler dump of rank 1: a worker thread idle in threading, the main thread asleep in
    the training script's load_batch."""
    return ('Thread 0x00007f1a2b3c4700 (most recent call first):\n'
            '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n'
            '  File "/usr/lib/python3.11/threading.py", line 629 in wait\n'
            '  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner\n'
            '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n'
            '\n'
            'Current thread 0x00007f1a2c5d6740 (most recent call first):\n'
            '  File "/job/train.py", line 42 in load_batch\n'
            '  File "/job/train.py", line 61 in step\n'
            '  File "/job/train.py", line 80 in <module>\n')


def test_stuck_rank_shows_its_stack(tmp_path):
    timed_out = "torus:all_reduce:ring #2 (rank 0 of 2, group '0'): timed out waiting for receive of 16 bytes " \
                "from rank 1 (the timeout of 5000 ms expired); rank 1 had not reached #2"
    _write(tmp_path,
           _dump(0, 2, [_entry(1), _entry(2, state="failed", error=timed_out)], "collective failed", stacks=None),
           _dump(1, 2, [_entry(1)], "a peer failed", stacks=_stuck_stacks()))
    code, out, err = _cli(tmp_path)
    assert code == 1 and not err, (code, out, err)
    assert "PROBLEM: collective #2 (torus:all_reduce:ring of [[4]] -> [[4]] Float SUM): rank 0 reached it; " \
        "rank 1 never did" in out, out
    stack = out[out.index("rank 1's Python"):]
    assert "main thread (wrote the dump):\n      /job/train.py:42 in load_batch\n      /job/train.py:61 in step" in \
        stack and "(1 idle thread)" in stack and "threading.py" not in stack, stack
    code, out, _ = _cli(tmp_path, "--json")
    threads = json.loads(out)["ranks"]["1"]["python_stacks"]
    assert [(t["main"], t["idle"], t["frames"][0]) for t in threads] == [
        (False, True, "/usr/lib/python3.11/threading.py:327 in wait"), (True, False, "/job/train.py:42 in load_batch")]


def test_rank_still_in_a_collective_the_others_passed(tmp_path):
    """Dumps on request: ranks 0 and 2 completed #3 and are in #4; rank 1 is still in #3."""
    done = [_entry(1), _entry(2), _entry(3)]
    _write(tmp_path, _dump(0, 3, done + [_entry(4, state="started", waiting="rank 1 had not reached #4")]),
           _dump(1, 3, done[:2] + [_entry(3, state="started")], stacks=_stuck_stacks()),
           _dump(2, 3, done + [_entry(4, state="started", waiting="rank 1 had not reached #4")]))
    found, text = _analyzed(tmp_path)
    primary = found["primary"]
    assert primary["seq"] == 3 and primary["still_in"] == [1] and primary["consequences"] == [4], primary
    assert found["problems"] == ["collective #3 (torus:all_reduce:ring of [[4]] -> [[4]] Float SUM): rank 1 still in "
                                 "it when it dumped; later collectives (#4) are its consequences"], found["problems"]
    assert "rank 1's Python" in text and "/job/train.py:42 in load_batch" in text, text


def _load_batch_slowly():
    time.sleep(8)


def _case_rank_asleep(ctx):
    """Rank 1 sleeps in Python while rank 0 times out at #2; both dump (rank 1 when asked, asleep)."""
    import datetime
    import re

    ctx.init_process_group(init="file")
    group = ctx.new_group(timeout=datetime.timedelta(seconds=2))
    dist.all_reduce(torch.ones(4), group=group)
    if ctx.rank == 1:
        _load_batch_slowly()
        return None
    try:
        dist.all_reduce(torch.ones(4), group=group)
        return "the all_reduce without rank 1 returned"
    except dist.DistBackendError as error:
        match = re.search(r"python -m torch_torus.trace (\S+)\)", str(error))
        return match.group(1) if match else f"no dump named: {error}"


def test_recorded_stuck_rank_shows_its_stack(tmp_path):
    results = harness.run_job("torus", 2, _case_rank_asleep, env={"TORUS_TRACE_DIR": str(tmp_path)}, timeout=90)
    assert results[1] is None and os.path.isdir(results[0]), results
    code, out, err = _cli(results[0])
    assert code == 1 and not err, (code, out, err)
    assert "PROBLEM: collective #2 (torus:all_reduce" in out and "rank 0 reached it; rank 1 never did" in out, out
    stack = out[out.index("rank 1's Python when it dumped"):]
    main = stack[stack.index("main thread"):]
    assert f"{__file__}:" in main and "in _load_batch_slowly" in main.splitlines()[1], stack


def test_stacks_as_faulthandler_writes_them(tmp_path):
    path = tmp_path / "stacks.txt"
    with open(path, "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)
    threads = python_stacks(path.read_text())
    (main,) = [t for t in threads if t["main"]]
    assert main["current"] and main["frames"][0].startswith(f"{__file__}:") and \
        main["frames"][0].endswith("in test_stacks_as_faulthandler_writes_them"), threads
