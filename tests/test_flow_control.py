"""Flow control: a rank that progresses on other traffic holds a bounded amount of payload it has
not asked for (TORUS_EAGER_WINDOW per peer), whatever its peers send ahead — over TCP and shared
memory, for point-to-point messages with tags and for collectives whose root runs ahead — and
messages still arrive whole and in order, whichever protocol (eager or ready-to-send) each took.
"""

import pytest

import harness

# Every transport keeps these promises: they also run over OFI (conftest.py).
TRANSPORT_CONTRACT = True

MiB = 1 << 20
# The bound: what a rank may hold that it has not asked for, per peer.
HELD_LIMIT = 96 * MiB
SMALL_TAG = 99


def _rss_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _touched(n, dtype):
    import torch

    t = torch.empty(n, dtype=dtype)
    t.fill_(0)
    return t


def _run_ahead(ctx, nbytes, count, start):
    """Rank 0 starts `count` transfers of `nbytes` with start(tensors), which returns their works,
    and then sends a small message (SMALL_TAG); rank 1 receives that first, while the transfers'
    messages arrive unasked. Rank 1 returns its `count` tensors (to complete the transfers into)
    and problems seen so far; rank 0 returns (None, [])."""
    import torch
    import torch.distributed as dist

    small = torch.zeros(4, dtype=torch.int32)
    if ctx.rank == 0:
        works = start([torch.full((nbytes,), k % 251, dtype=torch.uint8) for k in range(count)])
        dist.send(small + 7, 1, tag=SMALL_TAG)
        for work in works:
            work.wait()
        return None, []
    tensors = [_touched(nbytes, torch.uint8) for _ in range(count)]
    before = _rss_bytes()
    dist.recv(small, 0, tag=SMALL_TAG)
    grown = _rss_bytes() - before
    problems = []
    if grown > HELD_LIMIT:
        problems.append(f"resident memory grew by {grown / MiB:.0f} MiB while waiting for the small message "
                        f"(limit {HELD_LIMIT / MiB:.0f} MiB): payload nobody asked for was held")
    if small.tolist() != [7] * 4:
        problems.append(f"small message is {small.tolist()}")
    return tensors, problems


def _case_sends_ahead(ctx, nbytes, count, same_tag):
    """Point-to-point: rank 0 sends `count` messages ahead, then rank 1 receives them in order."""
    import torch
    import torch.distributed as dist

    tags = [1 if same_tag else k + 1 for k in range(count)]
    received, problems = _run_ahead(ctx, nbytes, count,
                                    lambda payloads: [dist.isend(p, 1, tag=t) for p, t in zip(payloads, tags)])
    for k, buf in enumerate(received or []):
        dist.recv(buf, 0, tag=tags[k])
        if not torch.equal(buf, torch.full_like(buf, k % 251)):
            problems.append(f"message {k} (tag {tags[k]}) holds {buf[:4].tolist()}..., expected {k % 251}")
            break
    return problems


@pytest.mark.parametrize("nbytes,count,same_tag", [
    (128 * MiB, 4, False),  # the case: large messages, each its own tag
    (64 * 1024, 2000, True),  # eager-sized messages past the window, in order on one tag
], ids=["4x128MiB", "2000x64KiB"])
def test_unasked_payload_is_bounded(backend, nbytes, count, same_tag):
    harness.check(backend, 2, _case_sends_ahead, nbytes, count, same_tag, timeout=180)


def _case_root_runs_ahead(ctx, nbytes, count):
    """Collectives: rank 0 starts `count` broadcasts ahead, then rank 1 joins them."""
    import torch
    import torch.distributed as dist

    tensors, problems = _run_ahead(ctx, nbytes, count,
                                   lambda sources: [dist.broadcast(t, 0, async_op=True) for t in sources])
    for k, t in enumerate(tensors or []):
        dist.broadcast(t, 0)
        if not torch.equal(t, torch.full_like(t, k % 251)):
            problems.append(f"broadcast {k} holds {t[:4].tolist()}..., expected {k % 251}")
            break
    return problems


def test_root_running_ahead_is_bounded(backend):
    harness.check(backend, 2, _case_root_runs_ahead, 2 * MiB, 96, timeout=180)


def _case_every_protocol(ctx, sizes):
    """Point-to-point of each size both ways, an allreduce and a broadcast of each: results
    exact under whatever TORUS_EAGER_* the pool was started with."""
    import torch
    import torch.distributed as dist

    problems = []
    n = ctx.world_size
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        t = torch.arange(count, dtype=torch.float32) + ctx.rank
        dist.all_reduce(t)
        expected = torch.arange(count, dtype=torch.float32) * n + n * (n - 1) / 2
        if not torch.equal(t, expected):
            problems.append(f"allreduce of {nbytes} bytes differs")
        b = torch.full((count,), float(ctx.rank))
        dist.broadcast(b, n - 1)
        if not torch.equal(b, torch.full_like(b, float(n - 1))):
            problems.append(f"broadcast of {nbytes} bytes differs")
        peer = ctx.rank ^ 1
        if peer < n:
            out = torch.full((count,), float(ctx.rank))
            into = torch.empty(count)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer, tag=5),
                                            dist.P2POp(dist.irecv, into, peer, tag=5)])
            for work in works:
                work.wait()
            if not torch.equal(into, torch.full_like(into, float(peer))):
                problems.append(f"exchange of {nbytes} bytes with rank {peer} differs")
    return problems


@pytest.mark.parametrize("eager", [
    {"TORUS_EAGER_BYTES": "0"},  # every message waits for its receive
    {"TORUS_EAGER_WINDOW": "64K"},  # a window smaller than a chunk
], ids=["no-eager", "small-window"])
def test_results_exact_under_any_eager_setting(backend, eager):
    harness.check(backend, 4, _case_every_protocol, [4, 4096, 300_000, 3 * MiB], env=eager)


def _wait_for_file(path, seconds):
    import os
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.01)
    return False


def _case_nobody_waits(ctx, nbytes, waiting_rank, name):
    """One rank posts its side (a send from rank 0, or a receive on rank 1) and does not wait
    on it; the other rank's blocking call must still complete (the transport's helper moves
    the first rank's request), after which the first rank waits."""
    import os

    import torch
    import torch.distributed as dist

    flag = os.path.join(ctx.scratch, f"{name}-done")
    if ctx.rank == waiting_rank:
        t = torch.full((nbytes,), 3, dtype=torch.uint8) if ctx.rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
        (dist.send if ctx.rank == 0 else dist.recv)(t, 1 - ctx.rank, tag=11)
        open(flag, "w").close()
        return [] if ctx.rank == 0 or bool((t == 3).all()) else ["received payload differs"]
    t = torch.full((nbytes,), 3, dtype=torch.uint8) if ctx.rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    work = (dist.isend if ctx.rank == 0 else dist.irecv)(t, 1 - ctx.rank, tag=11)
    problems = []
    if not _wait_for_file(flag, 30):
        problems.append(f"rank {1 - ctx.rank}'s blocking call did not complete in 30 s while this rank "
                        f"did not wait on its {'send' if ctx.rank == 0 else 'receive'}")
    work.wait()
    if ctx.rank == 1 and not bool((t == 3).all()):
        problems.append("received payload differs")
    return problems


@pytest.mark.parametrize("waiting_rank", [0, 1], ids=["receiver-does-not-wait", "sender-does-not-wait"])
def test_requests_progress_without_a_waiter(backend, waiting_rank, request):
    harness.check(backend, 2, _case_nobody_waits, 16 * MiB, waiting_rank, request.node.name, timeout=90)


def _case_dropped_receive(ctx, n):
    """Rank 1 posts a receive into a non-contiguous tensor (so into a stand-in buffer) and drops
    its Work; memory it allocates next must not be written by the message that arrives later."""
    import gc

    import torch
    import torch.distributed as dist

    if ctx.rank == 0:
        dist.recv(torch.zeros(1), 1, tag=21)  # rank 1 has dropped its receive
        dist.send(torch.full((n, n), 5.0), 1, tag=20)
        dist.barrier()  # its messages follow tag 20's: rank 1 has read that once it is through
        return []
    target = torch.zeros(n, n).t()
    work = dist.irecv(target, 0, tag=20)
    del work, target
    gc.collect()
    canaries = [torch.full((n, n), -1.0) for _ in range(8)]
    dist.send(torch.zeros(1), 0, tag=21)
    dist.barrier()
    spoiled = [k for k, c in enumerate(canaries) if not bool((c == -1.0).all())]
    return [f"canary tensors {spoiled} were written by a dropped receive"] if spoiled else []


@pytest.mark.parametrize("n", [64, 256, 1024], ids=["16KiB", "256KiB", "4MiB"])
def test_dropped_receive_writes_only_its_own_buffer(backend, n):
    harness.check(backend, 2, _case_dropped_receive, n)


def _case_receive_from_a_rank_that_gave_up(ctx, name):
    """Rank 0's send waits for a receive that is not posted in time: the send times out and rank
    0 gives up on the group. Rank 1 posts the receive afterwards: it must fail naming rank 0, not
    read the buffer of a rank that gave up and complete as a success."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    flag = os.path.join(ctx.scratch, f"{name}-gave-up")
    problems = []
    if ctx.rank == 0:
        payload = torch.full((1 << 20,), 3, dtype=torch.uint8)
        work = dist.isend(payload, 1, tag=31)
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=300))
            problems.append("the send completed although rank 1 had posted no receive")
        except Exception as error:  # noqa: BLE001 - any failure ends the group on this rank
            if "DistBackendError" not in type(error).__name__:
                problems.append(f"the send failed with {type(error).__name__}: {error}")
        open(flag, "w").close()
        return problems
    if not _wait_for_file(flag, 60):
        return ["rank 0 never reported"]
    received = torch.zeros(1 << 20, dtype=torch.uint8)
    try:
        dist.recv(received, 0, tag=31)
        problems.append("the receive completed as a success from a rank that had given up")
    except Exception as error:  # noqa: BLE001
        if "rank 0" not in str(error):
            problems.append(f"the receive's error does not name rank 0: {error}")
    return problems


def test_receive_from_a_rank_that_gave_up_fails(backend, request):
    # The group fails on both ranks: a throw-away pool.
    harness.check(backend, 2, _case_receive_from_a_rank_that_gave_up, request.node.name, timeout=90)
    harness.discard_pool(backend, 2)
