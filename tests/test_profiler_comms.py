"""record_param_comms in profiler traces (issue 40): every collective and point-to-point call gives
the event ProcessGroupNCCL gives, with the fields trace tools (Kineto's JSON, HTA, Chakra) read;
a batch_isend_irecv gives one event for the batch, with its totals. Checked in the chrome trace
torch.profiler exports, against the calls each rank made; the spans named for the algorithm stay.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import harness

FIELDS = ("Collective name", "In msg nelems", "Out msg nelems", "dtype", "Group size", "Process Group Name",
          "Process Group Ranks", "Global rank start", "Global rank stride", "Seq", "In split size", "Out split size")


def _case_profiled_calls(ctx):
    rank, world = ctx.rank, ctx.world_size
    even = ctx.new_group(ranks=list(range(0, world, 2))) if world > 2 else None
    member = even is not None and rank % 2 == 0
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(12))
        dist.all_gather_into_tensor(torch.empty(5 * world, dtype=torch.int64), torch.ones(5, dtype=torch.int64))
        dist.reduce_scatter_tensor(torch.empty(6, dtype=torch.float64), torch.ones(6 * world, dtype=torch.float64))
        dist.broadcast(torch.ones(7, dtype=torch.bfloat16), src=0)
        if rank == 0:
            dist.send(torch.ones(9), dst=1)
        elif rank == 1:
            dist.recv(torch.empty(9), src=0)
        ops = [dist.P2POp(dist.isend, torch.ones(4), nxt), dist.P2POp(dist.irecv, torch.empty(4), prev),
               dist.P2POp(dist.isend, torch.ones(3), prev), dist.P2POp(dist.irecv, torch.empty(3), nxt)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.all_to_all_single(torch.empty(2 * world, dtype=torch.int32), torch.ones(2 * world, dtype=torch.int32),
                               output_split_sizes=[2] * world, input_split_sizes=[2] * world)
        if member:
            dist.all_reduce(torch.ones(11), group=even)
        # Coalesced collectives: one allreduce_coalesced for both, which the batch's work covers.
        coalesced = [torch.ones(3), torch.ones(5)]
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as manager:
            for tensor in coalesced:
                dist.all_reduce(tensor)
        manager.wait()
    path = os.path.join(ctx.scratch, f"profiler_comms_rank{rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)["traceEvents"]
    events = [{k: e["args"].get(k) for k in FIELDS} for e in trace if e.get("name") == "record_param_comms"]
    spans = sorted({e["name"] for e in trace if e.get("name", "").startswith("torus:")})
    if any(not torch.equal(t, torch.full_like(t, world)) for t in coalesced):
        raise AssertionError(f"the coalesced all_reduce gave {coalesced}")
    return {"events": events,
            "spans": spans, "world": dist.group.WORLD.group_name,
            "even": even.group_name if member else None}


def _expected(rank, world):
    everyone = str(list(range(world)))
    calls = [("allreduce", 12, 12, "Float"), ("_allgather_base", 5, 5 * world, "Long"),
             ("_reduce_scatter_base", 6 * world, 6, "Double"), ("broadcast", 7, 7, "BFloat16")]
    expected = [dict(zip(("Collective name", "In msg nelems", "Out msg nelems", "dtype"), call), **{
        "Group size": world, "Process Group Ranks": everyone, "Global rank start": 0, "Global rank stride": 1})
        for call in calls]
    if rank in (0, 1):
        expected.append({"Collective name": "send" if rank == 0 else "recv", "In msg nelems": 9, "Out msg nelems": 9,
                         "dtype": "Float", "Group size": world})
    # One event for the batch: in, what it sends (4 + 3); out, what it receives.
    expected.append({"Collective name": "coalesced", "In msg nelems": 7, "Out msg nelems": 7, "dtype": "Float",
                     "Group size": world})
    expected.append({"Collective name": "all_to_allv", "In msg nelems": 2 * world, "Out msg nelems": 2 * world,
                     "dtype": "Int", "Group size": world, "In split size": str([2] * world),
                     "Out split size": str([2] * world)})
    if world > 2 and rank % 2 == 0:
        even = list(range(0, world, 2))
        expected.append({"Collective name": "allreduce", "In msg nelems": 11, "Out msg nelems": 11, "dtype": "Float",
                         "Group size": len(even), "Process Group Ranks": str(even), "Global rank start": 0,
                         "Global rank stride": 2})
    expected.append({"Collective name": "allreduce_coalesced", "In msg nelems": 8, "Out msg nelems": 8,
                     "dtype": "Float", "Group size": world, "Process Group Ranks": everyone})
    return expected


@pytest.mark.parametrize("world", [2, 3])
def test_record_param_comms_events(world):
    results = harness.run("torus", world, _case_profiled_calls, timeout=120)
    problems = []
    for rank, result in enumerate(results):
        events, expected = result["events"], _expected(rank, world)
        if len(events) != len(expected):
            problems.append(f"rank {rank}: {len(events)} record_param_comms events, expected {len(expected)}: "
                            f"{[e['Collective name'] for e in events]}")
            continue
        for got, want in zip(events, expected):
            wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
            if wrong:
                problems.append(f"rank {rank} {want['Collective name']}: (got, expected) {wrong}")
        collectives = [e for e in events if e["Collective name"] not in ("send", "recv", "coalesced")]
        world_seqs = [e["Seq"] for e in collectives if e["Group size"] == world]
        if world_seqs != list(range(world_seqs[0], world_seqs[0] + len(world_seqs))):
            problems.append(f"rank {rank}: the world group's collectives are numbered {world_seqs}")
        names = {e["Process Group Name"] for e in collectives if e["Group size"] == world}
        if names != {result["world"]}:
            problems.append(f"rank {rank}: group names {names}, expected {result['world']!r}")
        if result["even"] is not None and collectives[-2]["Process Group Name"] != result["even"]:
            problems.append(f"rank {rank}: the subgroup's event names {collectives[-2]['Process Group Name']!r}, "
                            f"expected {result['even']!r}")
        # The spans named for the algorithm that ran stay beside the events.
        for span in ("torus:all_reduce", "torus:broadcast", "torus:coalesced"):
            if not any(s.startswith(span) for s in result["spans"]):
                problems.append(f"rank {rank}: no {span} span among {result['spans']}")
    assert not problems, "\n".join(problems)
