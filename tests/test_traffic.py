"""Groups over several hosts: torch_torus.traffic (bytes each rank sends to its own host and to
other hosts, which shows a host-rowed torus keeping traffic off the links between hosts), and
the shm+tcp transport auto picks for them (shared memory inside a host, TCP between hosts).
Hosts are told apart by TORUS_HOST_ID (pg_options host_id), so one machine stands for several."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import harness

MIB = 1 << 20


def _case_traffic(ctx, algorithm, transport):
    import torch_torus

    # Ranks 0, 1 on host a; 2, 3 on host b: the torus's rows are the hosts.
    options = torch_torus.Options(host_id=f"host-{'ab'[ctx.rank // 2]}", allreduce=algorithm, transport=transport)
    group = ctx.new_group(list(range(ctx.world_size)), pg_options=options)
    t = torch.ones(MIB // 4)
    torch_torus.reset_traffic(group)
    dist.all_reduce(t, group=group)
    sent = torch_torus.traffic(group)
    torch_torus.reset_traffic(group)
    after_reset = torch_torus.traffic(group)
    dist.destroy_process_group(group)
    problems = [] if t.eq(ctx.world_size).all() else [f"wrong sum {t[:4].tolist()}"]
    if any(after_reset.values()):
        problems.append(f"reset_traffic left {after_reset}")
    return problems, sent


# Per rank, allreduce of S bytes on 2 hosts x 2 ranks. Ring 0-1-2-3: each rank sends 2(n-1)/n S =
# 1.5 S, to its right neighbour, which is on the other host for ranks 1 and 3. Torus: the row
# reduce-scatter and allgather send S/2 each inside the host, the column allreduce of S/2 between
# two ranks sends S/2 to the other host.
EXPECTED = {
    "ring": {0: (1.5 * MIB, 0), 1: (0, 1.5 * MIB), 2: (1.5 * MIB, 0), 3: (0, 1.5 * MIB)},
    "torus": {r: (1.0 * MIB, 0.5 * MIB) for r in range(4)},
}


@pytest.mark.parametrize("transport", ["tcp", "auto"])
@pytest.mark.parametrize("algorithm", list(EXPECTED))
def test_traffic_by_host(algorithm, transport):
    backend = "torus+tcp"
    results = harness.run(backend, 4, _case_traffic, algorithm, transport, timeout=60)
    harness.conclude(harness.problems([found for found, _ in results]), None, f"{backend} traffic")
    for rank, (_, sent) in enumerate(results):
        same, other = EXPECTED[algorithm][rank]
        assert (sent["same_host_bytes"], sent["other_host_bytes"]) == (same, other), \
            f"rank {rank} under {algorithm}: {sent}, expected {same:.0f} same-host and {other:.0f} other-host bytes"
        assert sent["same_host_messages"] + sent["other_host_messages"] > 0


def test_traffic_needs_a_torus_group():
    import torch_torus

    with pytest.raises(RuntimeError, match="no process group"):
        torch_torus.traffic()


def _case_hosts_share_memory(ctx, ranks_per_host):
    import torch_torus
    from reference import gen_all

    n = ctx.world_size
    problems = []
    for algorithm in ["ring", "torus", "direct", "recursive_doubling", "rabenseifner"]:
        options = torch_torus.Options(host_id=f"host-{ctx.rank // ranks_per_host}", allreduce=algorithm,
                                      transport="auto")
        group = ctx.new_group(list(range(n)), pg_options=options)
        transport = group._get_backend(torch.device("cpu")).config.transport
        if transport != "shm+tcp":
            problems.append(f"auto chose {transport} for {n // ranks_per_host} hosts x {ranks_per_host} ranks")
        for count in [1, 1000, 300_001]:
            inputs = gen_all(("hosts", algorithm, count), n, (count,), "float64")
            t = inputs[ctx.rank].clone()
            dist.all_reduce(t, group=group)
            if not torch.allclose(t, sum(inputs)):
                problems.append(f"{algorithm} allreduce of {count} doubles is wrong")
        b = torch.full((5000,), float(ctx.rank))
        dist.broadcast(b, group_src=n - 1, group=group)
        gathered = torch.empty(n * 100)
        dist.all_gather_into_tensor(gathered, torch.full((100,), float(ctx.rank)), group=group)
        if not b.eq(n - 1).all() or not gathered.view(n, 100).eq(torch.arange(n).view(n, 1)).all():
            problems.append(f"broadcast or all_gather wrong under {algorithm}")
        # Point-to-point, including from any source, goes by TCP between every pair.
        if ctx.rank == 0:
            got = sorted(int(dist.recv(torch.empty(3), group=group)) for _ in range(n - 1))
            if got != list(range(1, n)):
                problems.append(f"recv from any source got {got}")
        else:
            dist.send(torch.full((3,), float(ctx.rank)), group_dst=0, group=group)
        dist.destroy_process_group(group)
    return problems


@pytest.mark.parametrize("world_size,ranks_per_host", [(4, 2), (6, 3), (6, 2)])
def test_hosts_share_memory_inside(world_size, ranks_per_host):
    harness.check("torus+tcp", world_size, _case_hosts_share_memory, ranks_per_host, timeout=120)
