"""TCP connections at scale: a group connects to a peer when an algorithm first needs it, so a
rank holds sockets only to the peers its collectives talk to, however large the group. Counted
from the kernel's side: the process's TCP sockets in /proc/net/tcp{,6}, by state."""

from __future__ import annotations

import os

import pytest

import harness

WORLD = 32


def _tcp_sockets(tables=("/proc/net/tcp", "/proc/net/tcp6")) -> dict[str, int]:
    """This process's TCP sockets (IPv4 and IPv6, or those of `tables`): {"listening": n,
    "connected": m}."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    # By inode: a read of /proc/net/tcp that races with sockets coming and going may show one twice.
    states = {}
    for table in tables:
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[9] in inodes:
                states[fields[9]] = fields[3]
    counts = {"listening": sum(state == "0A" for state in states.values()),
              "connected": sum(state == "01" for state in states.values())}
    return counts


def _dissemination_peers(rank: int, size: int) -> set[int]:
    """The peers a dissemination barrier exchanges with: rank ± 2^k."""
    peers, step = set(), 1
    while step < size:
        peers |= {(rank + step) % size, (rank - step) % size}
        step *= 2
    return peers


def _case_sockets(ctx):
    import time

    import torch
    import torch.distributed as dist

    rank, size = ctx.rank, ctx.world_size
    before = _tcp_sockets()
    ctx.init_process_group(init="file")
    store = dist.distributed_c10d._get_default_store()

    def everyone_measured(stage):
        # Through the store: a collective would connect ranks while others still count.
        store.add(stage, 1)
        while int(store.add(stage, 0)) < size:
            time.sleep(0.01)

    counts = {"created": _tcp_sockets()}
    everyone_measured("created")
    t = torch.full((1000,), float(rank))
    dist.all_reduce(t)
    counts["ring allreduce"] = _tcp_sockets()
    everyone_measured("ring allreduce")
    dist.barrier()
    counts["barrier"] = _tcp_sockets()
    everyone_measured("barrier")
    expected_sum = size * (size - 1) / 2
    problems = [] if t.eq(expected_sum).all() else [f"allreduce gave {t[:4].tolist()}, expected {expected_sum}"]
    expected = {
        "created": (1, 0),
        "ring allreduce": (1, 2),
        "barrier": (1, len(_dissemination_peers(rank, size) | {(rank + 1) % size, (rank - 1) % size})),
    }
    for stage, (listening, connected) in expected.items():
        got = (counts[stage]["listening"] - before["listening"], counts[stage]["connected"] - before["connected"])
        if got != (listening, connected):
            problems.append(f"after {stage}: {got[0]} listening and {got[1]} connected sockets of the group, "
                            f"expected {listening} and {connected}")
    dist.destroy_process_group()
    return problems


@pytest.mark.parametrize("transport", ["tcp"])
def test_a_32_rank_group_connects_only_to_the_peers_it_uses(transport):
    """A 32-rank TCP group on this machine: at creation each rank listens and has connected to
    nobody; a ring allreduce connects it to its two neighbours; a barrier to the peers the
    dissemination pattern names. A full mesh would be 31 sockets per rank (8191 at 8192 ranks)."""
    results = harness.run_job("torus", WORLD, _case_sockets, init="none",
                              env={"TORUS_TRANSPORT": transport, "TORUS_ALLREDUCE": "ring"},
                              timeout=240)
    harness.conclude(harness.problems(results))


def _case_ipv6(ctx):
    import os

    import torch
    import torch.distributed as dist

    # The address routing to MASTER_ADDR is the one a rank listens on (a FileStore has none).
    os.environ["MASTER_ADDR"] = "::1"
    ctx.init_process_group(init="file")
    t = torch.full((4096,), float(ctx.rank + 1))
    dist.all_reduce(t)
    peer = 1 - ctx.rank
    received = torch.empty(1 << 20)
    sent = torch.full((1 << 20,), float(ctx.rank))
    if ctx.rank == 0:
        dist.send(sent, peer)
        dist.recv(received, peer)
    else:
        dist.recv(received, peer)
        dist.send(sent, peer)
    over_ipv6 = _tcp_sockets(("/proc/net/tcp6",))
    dist.barrier()  # both have counted before either closes its end
    problems = []
    if not t.eq(3.0).all():
        problems.append(f"allreduce gave {t[:4].tolist()}")
    if not received.eq(float(peer)).all():
        problems.append("the message received over IPv6 is wrong")
    if over_ipv6 != {"listening": 1, "connected": 1}:
        problems.append(f"expected the group's sockets on IPv6, found {over_ipv6} there")
    dist.destroy_process_group()
    return problems


@pytest.mark.skipif(not os.path.exists("/proc/net/if_inet6"), reason="this machine has no IPv6")
def test_a_group_over_ipv6():
    results = harness.run_job("torus", 2, _case_ipv6, init="none", env={"TORUS_TRANSPORT": "tcp"}, timeout=120)
    harness.conclude(harness.problems(results))
