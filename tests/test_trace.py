"""The flight recorder and its analyzer (issue 40): what a hang or a mismatch leaves behind.

One rank of four stops calling collectives: every other rank's timeout writes its dump, its error
names the dump, the rank that stopped dumps too when asked (also while asleep in Python, with its
threads' stacks, over a FileStore and a TCPStore), and `python -m torch_torus.trace DIR` names the
missing rank and the collective's sequence number. Two ranks that issue different collectives: the
analyzer shows both signatures.
torch_torus.dump_trace() on request: every call of the group with its sizes, dtype, state and who
issued it; TORUS_TRACE_BUFFER=0 writes nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import harness


def _analyze(directory):
    run = subprocess.run([sys.executable, "-m", "torch_torus.trace", directory], capture_output=True, text=True,
                         timeout=60)
    found = subprocess.run([sys.executable, "-m", "torch_torus.trace", "--json", directory], capture_output=True,
                           text=True, timeout=60)
    return run.returncode, run.stdout + run.stderr, json.loads(found.stdout) if found.stdout else None


def _case_one_rank_stops(ctx):
    ctx.init_process_group(init="file")
    group = ctx.new_group(timeout=datetime.timedelta(seconds=2))
    t = torch.ones(1000)
    dist.all_reduce(t, group=group)  # #1, everybody
    if ctx.rank == 3:
        time.sleep(6)
        return None
    try:
        dist.all_reduce(t, group=group)  # #2: rank 3 never comes
        return "the all_reduce without rank 3 returned"
    except dist.DistBackendError as error:
        match = re.search(r"flight recorder: (\S+rank\d\.json) \(every rank's: python -m torch_torus.trace (\S+)\)",
                          str(error))
        if not match:
            return f"the timeout's error does not name the dump: {error}"
        return {"file": match.group(1), "dir": match.group(2)}


def test_missing_rank_named_by_the_analyzer(tmp_path):
    results = harness.run_job("torus", 4, _case_one_rank_stops, env={"TORUS_TRACE_DIR": str(tmp_path)}, timeout=90)
    problems = [f"rank {r}: {res}" for r, res in enumerate(results) if isinstance(res, str)]
    assert not problems, problems
    dirs = {res["dir"] for res in results if isinstance(res, dict)}
    assert len(dirs) == 1 and str(tmp_path) in next(iter(dirs)), dirs
    directory = dirs.pop()
    # Rank 3, asleep, dumps too when the others fail.
    assert sorted(os.listdir(directory)) == ["rank0.json", "rank1.json", "rank2.json", "rank3.json"]
    code, text, found = _analyze(directory)
    assert code == 1, text
    assert found["missing"] == [3] and found["newest"] == 2, found
    assert "collective #2" in text and "rank 3" in text and "wrote no dump" not in text, text
    dump = json.load(open(os.path.join(directory, "rank0.json")))
    running = [e for e in dump["entries"] if e["collective_seq_id"] == 2]
    assert running and running[0]["state"] == "failed" and "rank 3" in running[0]["error"], running


def _case_mismatch(ctx):
    ctx.init_process_group(init="file")
    group = ctx.new_group(timeout=datetime.timedelta(seconds=20))
    dist.all_reduce(torch.ones(4), group=group)
    try:
        dist.all_reduce(torch.ones(4 if ctx.rank == 0 else 8), group=group)
        return "the mismatched all_reduce returned"
    except dist.DistBackendError as error:
        match = re.search(r"python -m torch_torus.trace (\S+)\)", str(error))
        return {"dir": match.group(1)} if match else f"no dump named: {error}"


def test_mismatch_shows_both_signatures(tmp_path):
    results = harness.run_job("torus", 2, _case_mismatch, env={"TORUS_TRACE_DIR": str(tmp_path)}, timeout=60)
    problems = [f"rank {r}: {res}" for r, res in enumerate(results) if isinstance(res, str)]
    assert not problems, problems
    code, text, found = _analyze(results[0]["dir"])
    assert code == 1, text
    (mismatch,) = found["mismatches"]
    assert mismatch["seq"] == 2, mismatch
    calls = {tuple(c["ranks"]): c["call"] for c in mismatch["calls"]}
    assert "[[4]]" in calls[(0,)] and "[[8]]" in calls[(1,)], calls
    assert "ranks called different collectives" in text, text


def _case_dump_on_request(ctx, buffer):
    ctx.init_process_group(init="file")
    import torch_torus

    group = ctx.new_group()
    t = torch.ones(3, 5)
    dist.all_reduce(t, group=group)
    parts = [torch.empty(7, dtype=torch.float64) for _ in range(ctx.world_size)]
    dist.all_gather(parts, torch.ones(7, dtype=torch.float64), group=group)
    dist.all_reduce(torch.ones(1, 2, 1, 2, 3), group=group)  # more dimensions than an entry holds inline
    work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    work.get_future().then(lambda _: dist.broadcast(torch.ones(6), src=0, group=group)).wait()
    if ctx.rank == 0:
        dist.send(torch.ones(9, dtype=torch.int32), 1, group=group)
    else:
        dist.recv(torch.empty(9, dtype=torch.int32), 0, group=group)
    path = torch_torus.dump_trace(group)
    if buffer == "0":
        return None if path == "" else f"TORUS_TRACE_BUFFER=0 wrote {path}"
    dump = json.load(open(path))
    entries = dump["entries"]
    problems = []
    # dtypes as torch's flight recorder names them (c10::toString)
    want = [("torus:all_reduce", [[3, 5]], "Float", "caller"), ("torus:all_gather", [[7]], "Double", "caller"),
            ("torus:all_reduce", [[1, 2, 1, 2, 3]], "Float", "caller"), ("torus:all_reduce", [[2]], "Float", "caller"),
            ("torus:broadcast", [[6]], "Float", "callback"),
            ("torus:send" if ctx.rank == 0 else "torus:recv", [[9]], "Int", "caller")]
    got = [(e["profiling_name"], e["input_sizes"], e["input_dtypes"][0], e["issued_by"]) for e in entries]
    if len(got) != len(want) or any(not g[0].startswith(w[0]) or g[1:] != w[1:] for g, w in zip(got, want)):
        problems.append(f"entries {got}, want {want}")
    if [e["collective_seq_id"] for e in entries[:4]] != [1, 2, 3, 4]:
        problems.append(f"sequence numbers {[e['collective_seq_id'] for e in entries]}")
    if any(e["state"] != "completed" or e["time_discovered_completed_ns"] is None for e in entries):
        problems.append(f"states {[e['state'] for e in entries]}")
    # A call run at once by its caller is written as started when it is recorded: its times still
    # run created <= started <= completed, like a queued one's.
    times = [(e["time_created_ns"], e["time_discovered_started_ns"], e["time_discovered_completed_ns"])
             for e in entries]
    if any(None in t or not t[0] <= t[1] <= t[2] for t in times):
        problems.append(f"times (created, started, completed) {times}")
    return problems


@pytest.mark.parametrize("buffer", ["2000", "0"])
def test_dump_on_request(tmp_path, buffer):
    harness.conclude(harness.problems(harness.run_job(
        "torus", 2, _case_dump_on_request, buffer,
        env={"TORUS_TRACE_DIR": str(tmp_path), "TORUS_TRACE_BUFFER": buffer}, timeout=60)), None, "torus")


def _slow_data_loader(seconds):
    time.sleep(seconds)


def _case_rank_asleep_in_python(ctx, init):
    """Rank 1 sleeps in Python (a slow data loader) while rank 0 times out in an all_reduce: both
    dump, rank 1's while it still sleeps, with where its Python was."""
    ctx.init_process_group(init=init)
    group = ctx.new_group(timeout=datetime.timedelta(seconds=3))
    dist.all_reduce(torch.ones(4), group=group)
    if ctx.rank == 1:
        asleep = time.monotonic()
        _slow_data_loader(10)
        return {"slept": time.monotonic() - asleep}
    try:
        dist.all_reduce(torch.ones(4), group=group)
        return "the all_reduce without rank 1 returned"
    except dist.DistBackendError as error:
        match = re.search(r"python -m torch_torus.trace (\S+)\)", str(error))
        return {"dir": match.group(1)} if match else f"no dump named: {error}"


@pytest.mark.parametrize("init", ["file", "tcp"])
def test_rank_asleep_in_python_dumps_with_its_stack(tmp_path, init):
    results = harness.run_job("torus", 2, _case_rank_asleep_in_python, init,
                              env={"TORUS_TRACE_DIR": str(tmp_path)}, timeout=90)
    problems = [f"rank {r}: {res}" for r, res in enumerate(results) if isinstance(res, str)]
    assert not problems, problems
    directory = results[0]["dir"]
    assert sorted(os.listdir(directory)) == ["rank0.json", "rank1.json"], os.listdir(directory)
    asleep = json.load(open(os.path.join(directory, "rank1.json")))
    failed = json.load(open(os.path.join(directory, "rank0.json")))
    # Rank 1 dumped while it slept (10 s), within a few seconds of rank 0's failure.
    gap = asleep["time_dumped_ns"] - failed["time_dumped_ns"]
    assert gap < 5e9, (asleep["time_dumped_ns"], failed["time_dumped_ns"])
    assert asleep["dump_reason"].startswith("rank 0 failed: "), asleep["dump_reason"]
    assert "_slow_data_loader" in (asleep["python_stacks"] or ""), asleep["python_stacks"]
    (entry,) = [e for e in failed["entries"] if e["collective_seq_id"] == 2]
    assert entry["state"] == "failed" and "rank 1" in entry["error"], entry
    code, text, found = _analyze(directory)
    assert code == 1 and 1 in found["missing"], text


def _case_p2p_timeout(ctx, which):
    """Rank 0's send or receive waits for rank 1, which sleeps in Python: rank 0's times out and
    dumps, and rank 1 dumps too, asked while it sleeps."""
    ctx.init_process_group(init="tcp")
    group = ctx.new_group(timeout=datetime.timedelta(seconds=2))
    dist.all_reduce(torch.ones(4), group=group)
    if ctx.rank == 1:
        _slow_data_loader(7)
        return None
    try:
        if which == "send":
            dist.send(torch.ones(1 << 22), 1, group=group)  # 16 MiB: waits for its receive
        else:
            dist.recv(torch.empty(4), 1, group=group)
        return f"the {which} without rank 1 returned"
    except dist.DistBackendError as error:
        match = re.search(r"python -m torch_torus.trace (\S+)\)", str(error))
        return {"dir": match.group(1)} if match else f"the {which}'s error names no dump: {error}"


@pytest.mark.parametrize("which", ["recv", "send"])
def test_point_to_point_timeout_dumps_on_both_ranks(tmp_path, which):
    results = harness.run_job("torus", 2, _case_p2p_timeout, which, env={"TORUS_TRACE_DIR": str(tmp_path)},
                              timeout=90)
    assert isinstance(results[0], dict), results
    directory = results[0]["dir"]
    assert sorted(os.listdir(directory)) == ["rank0.json", "rank1.json"], os.listdir(directory)
    mine = json.load(open(os.path.join(directory, "rank0.json")))
    (entry,) = [e for e in mine["entries"] if e["is_p2p"]]
    assert entry["state"] == "failed" and entry["error"], entry
    asleep = json.load(open(os.path.join(directory, "rank1.json")))
    assert "_slow_data_loader" in (asleep["python_stacks"] or ""), asleep


def _case_dumps_at_once(ctx):
    """Eight threads of each rank dump the same group at once, 20 times each."""
    import threading

    import torch_torus

    ctx.init_process_group(init="file")
    group = ctx.new_group()
    dist.all_reduce(torch.ones(4), group=group)
    paths, start = [], threading.Barrier(8)

    def dump():
        start.wait()
        for _ in range(20):
            paths.append(torch_torus.dump_trace(group))

    threads = [threading.Thread(target=dump) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(set(paths))


def test_dumps_at_once_leave_one_valid_file(tmp_path):
    results = harness.run_job("torus", 2, _case_dumps_at_once, env={"TORUS_TRACE_DIR": str(tmp_path)}, timeout=60)
    for rank, paths in enumerate(results):
        assert len(paths) == 1 and paths[0].endswith(f"rank{rank}.json"), paths
        directory = os.path.dirname(paths[0])
        assert json.load(open(paths[0]))["entries"][0]["profiling_name"].startswith("torus:all_reduce")
    assert sorted(os.listdir(directory)) == ["rank0.json", "rank1.json"], os.listdir(directory)


def _case_dump_where(ctx):
    import torch_torus

    ctx.init_process_group(init="file")
    group = ctx.new_group()
    dist.all_reduce(torch.ones(4), group=group)
    first = torch_torus.dump_trace(group)
    if first and ctx.rank == 0:
        # A link planted where the dump goes: the dump replaces the link and writes nothing through it.
        victim = os.path.join(os.path.dirname(os.path.dirname(first)), "victim")
        with open(victim, "w") as f:
            f.write("keep")
        os.unlink(first)
        os.symlink(victim, first)
        second = torch_torus.dump_trace(group)
        return {"first": first, "second": second, "victim": open(victim).read(), "link": os.path.islink(first)}
    return {"first": first}


def test_dumps_never_follow_links(tmp_path):
    (result, _) = harness.run_job("torus", 2, _case_dump_where, env={"TORUS_TRACE_DIR": str(tmp_path / "base")},
                                  timeout=60)
    assert result["first"] and result["second"] == result["first"], result
    assert result["victim"] == "keep" and not result["link"], result
    assert oct(os.stat(tmp_path / "base").st_mode & 0o777) == "0o700"
    # A base directory that is a link (planted before the job) is refused: nothing is written through it.
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(target, tmp_path / "planted")
    results = harness.run_job("torus", 2, _case_dump_where, env={"TORUS_TRACE_DIR": str(tmp_path / "planted")},
                              timeout=60)
    assert [r["first"] for r in results] == ["", ""], results
    assert os.listdir(target) == [], os.listdir(target)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root (chown)")
def test_dumps_refuse_another_users_directory(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    results = harness.run_job("torus", 2, _case_dump_where, env={"TORUS_TRACE_DIR": str(theirs)}, timeout=60)
    assert [r["first"] for r in results] == ["", ""], results
    assert os.listdir(theirs) == [], os.listdir(theirs)


def _case_planned_endings(ctx, ending):
    ctx.init_process_group(init="file")
    group = ctx.new_group()
    dist.all_reduce(torch.ones(4), group=group)
    # Both ranks are past the group's all_reduce before either ends it (an abort is no goodbye:
    # a peer still reading the last message would fail).
    dist.barrier()
    if ending == "abort":
        group.abort()
    else:
        group.shutdown()
    return None


@pytest.mark.parametrize("ending", ["abort", "shutdown"])
def test_planned_ending_with_nothing_running_writes_no_dump(tmp_path, ending):
    harness.run_job("torus", 2, _case_planned_endings, ending, env={"TORUS_TRACE_DIR": str(tmp_path)}, timeout=60)
    assert [name for _, _, files in os.walk(tmp_path) for name in files] == []
