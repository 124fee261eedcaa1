"""dist.shrink_group on torus groups: the ranks that remain carry on as a smaller group, without a
restart.

4 ranks over shm and over tcp, fresh processes per case (a rank dies on purpose, which the
harness's pools take for a failure). Rank 2 SIGKILLed between collectives (the others shrink with
SHRINK_DEFAULT) or inside a 64 MiB all_reduce (the others' all_reduce fails naming it; they shrink
with SHRINK_ABORT); rank 3 alive but left out of a subgroup the others shrink; a shrink with a
collective still waiting for the rank left out (SHRINK_DEFAULT refused, naming SHRINK_ABORT, which
then aborts it). Each time the 3 ranks run every collective against the one-process reference and
train DDP to a 3-rank reference, and shrinking and destroying return well within the timeout.
The new group inherits the old group's torch_torus.Options unless shrink_group's pg_options
override them. Every run is bounded."""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import queue as queues
import signal
import time
import traceback
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import SHRINK_ABORT

import harness
from reference import compare, first_line, gen, gen_all, reduce_ref, tolerance
from test_ddp import _diff, _reference, _train

WORLD = 4
TIMEOUT_S = 60
# Well under the group's timeout: a shrink or a destroy that took longer waited something out.
PROMPT_S = TIMEOUT_S / 2
# 64 MiB of float32: the victim dies while its peers are still inside the all_reduce.
LARGE = 16 * 1024 * 1024


def _collective_problems(group) -> list[str]:
    """Every collective on `group` against the one-process reference (ranks as the group numbers
    them)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    problems = []
    for dtype, op in (("float32", "SUM"), ("int64", "MAX"), ("bfloat16", "SUM")):
        inputs = gen_all(("shrink", dtype, op), n, (1031,), dtype, op)
        t = inputs[rank].clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        ref = reduce_ref(inputs, op)
        problems += compare(t, ref, tolerance(inputs, op, ref), f"all_reduce {dtype} {op}")
    for root in range(n):
        t = gen(("bcast", root), rank, (77,), "float32")
        dist.broadcast(t, group=group, group_src=root)
        problems += compare(t, gen(("bcast", root), root, (77,), "float32"), None, f"broadcast from {root}")
        inputs = gen_all(("reduce", root), n, (33,), "int32")
        t = inputs[rank].clone()
        dist.reduce(t, group=group, group_dst=root)
        if rank == root:
            problems += compare(t, reduce_ref(inputs, "SUM"), None, f"reduce to {root}")
    mine = gen("gather", rank, (13,), "float64")
    everyone = gen_all("gather", n, (13,), "float64")
    outputs = [torch.empty(13, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(outputs, mine, group=group)
    problems += compare(torch.cat(outputs), torch.cat(everyone), None, "all_gather")
    out = torch.empty(n * 13, dtype=torch.float64)
    dist.all_gather_into_tensor(out, mine, group=group)
    problems += compare(out, torch.cat(everyone), None, "all_gather_into_tensor")
    gathered = [torch.empty(13, dtype=torch.float64) for _ in range(n)] if rank == 1 else None
    dist.gather(mine, gathered, group=group, group_dst=1)
    if rank == 1:
        problems += compare(torch.cat(gathered), torch.cat(everyone), None, "gather to 1")
    scattered = torch.empty(13, dtype=torch.float64)
    dist.scatter(scattered, everyone if rank == 2 else None, group=group, group_src=2)
    problems += compare(scattered, everyone[rank], None, "scatter from 2")
    inputs = gen_all("reduce_scatter", n, (n * 19,), "float32")
    out = torch.empty(19, dtype=torch.float32)
    dist.reduce_scatter_tensor(out, inputs[rank].clone(), group=group)
    blocks = [x[rank * 19:(rank + 1) * 19] for x in inputs]
    ref = reduce_ref(blocks, "SUM")
    problems += compare(out, ref, tolerance(blocks, "SUM", ref), "reduce_scatter_tensor")
    out = torch.empty(n * 5, dtype=torch.int32)
    dist.all_to_all_single(out, gen("a2a", rank, (n * 5,), "int32"), group=group)
    expected = torch.cat([gen("a2a", r, (n * 5,), "int32")[rank * 5:(rank + 1) * 5] for r in range(n)])
    problems += compare(out, expected, None, "all_to_all_single")
    received = torch.empty(9)
    work = dist.irecv(received, group=group, group_src=(rank - 1) % n)
    dist.send(gen("p2p", rank, (9,), "float32"), group=group, group_dst=(rank + 1) % n)
    work.wait()
    problems += compare(received, gen("p2p", (rank - 1) % n, (9,), "float32"), None, "send/recv around the ring")
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank}, group=group)
    if objects != [{"rank": r} for r in range(n)]:
        problems.append(f"all_gather_object gave {objects}")
    dist.barrier(group=group)
    # torch.ops.torus reaches the group by the name torch gave it.
    t = torch.ones(5)
    torch.ops.torus.all_reduce_(t, group.group_name, "sum")
    problems += compare(t, torch.full((5,), float(n)), None, "torch.ops.torus.all_reduce_")
    return problems


def _after_shrink(group, rank, shrunk_in, report) -> list[str]:
    """What every rank left checks in its new group: numbering, collectives, DDP, destroy."""
    problems = []
    if group.size() != WORLD - 1:
        problems.append(f"the new group has {group.size()} ranks, not {WORLD - 1}")
    report["new_rank"] = group.rank()
    report["shrink_s"] = shrunk_in
    problems += _collective_problems(group)
    trained = _train(types.SimpleNamespace(rank=group.rank()), group, "none", 25)
    problems += _diff(trained, _reference(WORLD - 1), 1e-4, 1e-5, "DDP on the shrunk group vs a 3-rank reference")
    report["chunk_bytes"] = group._get_backend(torch.device("cpu")).config.chunk_bytes
    return problems


def _rank(rank, port, transport, scenario, victim, queue, victim_gone):
    """One rank's part; reports (rank, problems, report) to `queue`, a raise as a problem."""
    try:
        _play(rank, port, transport, scenario, victim, queue, victim_gone)
    except Exception:  # noqa: BLE001 - reported to the test
        queue.put((rank, [traceback.format_exc()], {"rank": rank}))


def _play(rank, port, transport, scenario, victim, queue, victim_gone):
    faulthandler.enable()  # a crash shows its stack in the test's output
    os.environ["TORUS_TRANSPORT"] = transport
    import torch_torus

    # Options the new group inherits (between collectives) or that the shrink's override replaces.
    dist.init_process_group("torus", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S),
                            pg_options=torch_torus.Options(chunk_bytes="128K"))
    dist.all_reduce(torch.ones(1000))
    store = dist.distributed_c10d._get_default_store()
    report, problems = {"rank": rank}, []
    if scenario == "between_collectives":
        if rank == victim:
            store.wait([f"warm/{r}" for r in range(WORLD) if r != victim])
            os.kill(os.getpid(), signal.SIGKILL)
        store.set(f"warm/{rank}", "1")
        if not victim_gone.wait(30):
            problems.append("the victim was not seen dead within 30 s")
        start = time.monotonic()
        group = dist.shrink_group([victim])
    elif scenario == "inside_a_collective":
        tensor = torch.ones(LARGE)
        if rank == victim:
            # Dead while the others are inside the all_reduce, which cannot complete without it (a
            # victim that joined it first could be done with its part on a quiet machine).
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(tensor)
            problems.append("the all_reduce the victim died in returned")
        except dist.DistBackendError as error:
            report["error"] = first_line(error)
            if f"rank {victim}" not in str(error):
                problems.append(f"the all_reduce's error does not name rank {victim}: {first_line(error)}")
        start = time.monotonic()
        group = dist.shrink_group([victim], shrink_flags=SHRINK_ABORT)
    elif scenario == "rank_left_out":
        subgroup = dist.new_group(list(range(WORLD)))
        if rank == victim:  # alive, out of the new group; the world stays whole
            dist.all_reduce(torch.ones(1))
            dist.destroy_process_group()
            queue.put((rank, [], report))
            return
        try:
            dist.shrink_group([WORLD], group=subgroup)
            problems.append(f"shrink_group([{WORLD}]) was accepted")
        except ValueError:
            pass
        start = time.monotonic()
        group = dist.shrink_group([victim], group=subgroup, pg_options=torch_torus.Options(chunk_bytes="64K"))
    elif scenario == "work_pending":
        if rank == victim:  # never joins the all_reduce below
            store.set("warm", "1")  # its warm-up done: the others' abort cannot cut it short
            victim_gone.wait(90)
            dist.destroy_process_group()
            queue.put((rank, [], report))
            return
        store.wait(["warm"])
        pending = dist.all_reduce(torch.ones(8), async_op=True)
        try:
            dist.shrink_group([victim])
            problems.append("SHRINK_DEFAULT shrank a group with a collective running")
        except RuntimeError as error:
            if "SHRINK_ABORT" not in str(error):
                problems.append(f"SHRINK_DEFAULT's refusal does not name SHRINK_ABORT: {first_line(error)}")
        # Every survivor tries SHRINK_DEFAULT before any aborts: a group failed by a peer's abort
        # is failed, which SHRINK_DEFAULT shrinks.
        store.set(f"refused/{rank}", "1")
        store.wait([f"refused/{r}" for r in range(WORLD) if r != victim])
        start = time.monotonic()
        group = dist.shrink_group([victim], shrink_flags=SHRINK_ABORT)
        try:
            pending.wait()
            problems.append("the all_reduce SHRINK_ABORT aborted returned")
        except dist.DistBackendError:
            pass
    else:
        raise ValueError(scenario)
    problems += _after_shrink(group, rank, time.monotonic() - start, report)
    if scenario == "rank_left_out":
        world = torch.ones(1)
        dist.all_reduce(world)  # with the rank left out of the shrunk subgroup
        if world.item() != WORLD:
            problems.append(f"the world's all_reduce gave {world.item()}")
    start = time.monotonic()
    dist.destroy_process_group()
    report["destroy_s"] = time.monotonic() - start
    queue.put((rank, problems, report))


SCENARIOS = ["between_collectives", "inside_a_collective", "rank_left_out", "work_pending"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_shrink_group(backend, tmp_path, scenario):
    name, env = harness.split_backend(backend)
    if name != "torus":
        pytest.skip(f"{backend}: torus's shrink (gloo does not support shrinking)")
    victim = 3 if scenario in ("rank_left_out", "work_pending") else 2
    killed = scenario in ("between_collectives", "inside_a_collective")
    port = harness.free_port()
    context = multiprocessing.get_context("spawn")
    queue, victim_gone = context.Queue(), context.Event()
    procs = [context.Process(target=_rank, args=(r, port, env["TORUS_TRANSPORT"], scenario,
                                                  victim, queue, victim_gone))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    reports = []
    deadline = time.monotonic() + 150
    try:
        if killed:
            procs[victim].join(60)
            victim_gone.set()
        while len(reports) < (WORLD - 1 if killed else WORLD) and time.monotonic() < deadline:
            try:
                reports.append(queue.get(timeout=1))
            except queues.Empty:
                reported = {rank for rank, _, _ in reports}
                ended = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported
                         and not (killed and r == victim)]
                if ended:
                    pytest.fail(f"rank(s) {ended} ended without a report (exit codes "
                                f"{[procs[r].exitcode for r in ended]}); reports: {reports}")
            if scenario == "work_pending" and len(reports) == WORLD - 1:
                victim_gone.set()  # the others have shrunk: the rank left out may go
        if time.monotonic() >= deadline:
            pytest.fail(f"no report from every rank within 150 s; reports: {reports}")
    finally:
        victim_gone.set()
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    if killed and procs[victim].exitcode != -signal.SIGKILL:
        pytest.fail(f"rank {victim} ended with {procs[victim].exitcode}, not SIGKILL")
    found = [f"rank {rank}: {p}" for rank, problems, _ in reports for p in problems]
    survivors = sorted((r for _, _, r in reports if r["rank"] != victim), key=lambda r: r["rank"])
    if [r["new_rank"] for r in survivors if "new_rank" in r] != [0, 1, 2]:
        found.append(f"the ranks left are not numbered 0, 1, 2 in their old order: {survivors}")
    want_chunk = 64 * 1024 if scenario == "rank_left_out" else 128 * 1024
    for r in survivors:
        if r.get("chunk_bytes") != want_chunk:
            found.append(f"rank {r['rank']}: the new group's chunk_bytes is {r.get('chunk_bytes')}, not {want_chunk}")
        for what in ("shrink_s", "destroy_s"):
            if r.get(what, 0) > PROMPT_S:
                found.append(f"rank {r['rank']}: {what} {r[what]:.1f} s, over {PROMPT_S:g} s")
    print(f"{backend} {scenario}: shrink " + ", ".join(f"{r.get('shrink_s', -1):.2f}" for r in survivors)
          + " s; destroy " + ", ".join(f"{r.get('destroy_s', -1):.2f}" for r in survivors) + " s")
    harness.conclude(found, None, f"{backend} {scenario}")
