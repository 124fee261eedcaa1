"""Faults: ranks that call different collectives, ranks killed mid-collective, and long runs
that must not grow. Each over both transports (the backend parameter).

The promise checked here: no hang, no silently wrong result, and an error that names the
collective, its sequence number and the ranks involved."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import re
import resource
import signal
import time

import pytest
import torch
import torch.distributed as dist

import harness
from reference import TORCH_ERROR_WORDS, first_line

# Every transport keeps these promises: they also run over OFI (conftest.py).
TRANSPORT_CONTRACT = True

# Long enough for a loaded CI machine, far shorter than any timeout the cases set: a mismatch
# must be found within it, not waited out.
PROMPT_SECONDS = 10.0


def _transports(backend: str) -> str:
    name, env = harness.split_backend(backend)
    if name != "torus":
        pytest.skip(f"{backend}: these are torus's promises (gloo leaves mismatches undetected)")
    return env["TORUS_TRANSPORT"]


# ------------------------------------------------------------------ ranks that disagree


def _mismatched_call(kind: str, rank: int, group) -> None:
    """One collective in which rank 1 disagrees with the others in the way `kind` names."""
    odd = rank == 1
    if kind == "size":
        dist.all_reduce(torch.ones(1000 + odd), group=group)
    elif kind == "dtype":
        dist.all_reduce(torch.ones(1000, dtype=torch.int32 if odd else torch.float32), group=group)
    elif kind == "op":
        dist.all_reduce(torch.ones(1000), op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM, group=group)
    elif kind == "collective":
        t = torch.ones(1000)
        if odd:
            dist.broadcast(t, group_src=0, group=group)
        else:
            dist.all_reduce(t, group=group)
    elif kind == "root":
        dist.broadcast(torch.ones(1000), group_src=1 if odd else 0, group=group)
    elif kind == "large_size":
        dist.all_reduce(torch.ones((1 << 20) + 16 * odd), group=group)
    elif kind == "allgather_size":
        out = [torch.empty(100 + odd) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, torch.ones(100 + odd), group=group)
    else:
        raise ValueError(kind)


_LEFT_BEFORE_CONNECTED = re.compile(r"cannot connect to rank [01] .*\(rank [01] exited, was killed, or left the group")


def _case_mismatch(ctx, kind):
    group = ctx.new_group(list(range(ctx.world_size)))
    start = time.monotonic()
    error = None
    try:
        _mismatched_call(kind, ctx.rank, group)
        # Some disagreements (another root) show only in what is left over: the next call says so.
        dist.all_reduce(torch.ones(4), group=group)
    except Exception as e:  # noqa: BLE001 - the type is checked below
        error = e
    elapsed = time.monotonic() - start
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - a broken group may refuse; what matters was said above
        pass
    if error is None:
        return [f"the mismatch ({kind}) went unnoticed"], ""
    text = str(error)
    problems = []
    if not isinstance(error, dist.DistBackendError):
        problems.append(f"{type(error).__name__}, not DistBackendError: {first_line(error)}")
    # Ranks 0 and 1 disagree and each hears the other. A bystander hears of the mismatch from a
    # rank that gave up, unless that rank destroyed its group before the bystander first
    # connected to it (connections are made when first needed): then it can only say so.
    bystander_told_late = ctx.rank >= 2 and _LEFT_BEFORE_CONNECTED.search(text)
    if ("different collectives" not in text or "#" not in text) and not bystander_told_late:
        problems.append(f"the error does not say which collective disagreed: {text[:400]}")
    if elapsed > PROMPT_SECONDS:
        problems.append(f"took {elapsed:.1f}s to notice (waited out a timeout?)")
    return problems, text


NAMED = {
    "size": ["4000 bytes float32", "4004 bytes float32"],
    "dtype": ["4000 bytes float32", "4000 bytes int32"],
    "op": ["(sum", "(max"],
    "collective": ["all_reduce of 4000 bytes", "broadcast of 4000 bytes"],
    "root": ["root 0", "root 1"],
    "large_size": ["4194304 bytes", "4194368 bytes"],
    "allgather_size": ["all_gather of"],
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", list(NAMED))
def test_mismatch_named_on_both_sides(backend, world_size, kind):
    _transports(backend)
    results = harness.run(backend, world_size, _case_mismatch, kind, timeout=60)
    harness.conclude(harness.problems([found for found, _ in results]), None, f"{backend} mismatch {kind}")
    texts = [text for _, text in results]
    # Some rank names both sides, with each side's own description.
    assert any(all(want in text for want in NAMED[kind]) and "rank 0" in text and "rank 1" in text
               for text in texts), f"no rank names both sides of the {kind} mismatch: {texts}"


# ------------------------------------------------------------------ a rank killed mid-collective


def _run_kind(kind: str, rank: int, world_size: int, shared_tensors: bool = False) -> None:
    n = 1 << 16
    if shared_tensors:
        # From allocate_tensor: peers read and write them with their own loads and stores.
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))

        def empty(count):
            return backend.allocate_tensor(count, dtype=torch.float32, device=torch.device("cpu"))
    else:
        def empty(count):
            return torch.empty(count)

    def ones(count):
        return empty(count).fill_(1)

    if kind == "all_reduce":
        dist.all_reduce(ones(n))
    elif kind == "broadcast":
        dist.broadcast(ones(n), src=0)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(empty(n * world_size), ones(n))
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(empty(n), ones(n * world_size))
    elif kind == "all_to_all":
        dist.all_to_all_single(empty(n * world_size), ones(n * world_size))
    elif kind == "gather":
        dist.gather(ones(n), [empty(n) for _ in range(world_size)] if rank == 0 else None, dst=0)
    elif kind == "reduce":
        dist.reduce(ones(n), dst=0)
    elif kind == "barrier":
        dist.barrier()
    elif kind == "send_recv":
        if rank == 0:
            for peer in range(1, world_size):
                dist.recv(empty(n), src=peer)
        else:
            dist.send(ones(n), dst=0)
    else:
        raise ValueError(kind)


def _killed_rank(rank, world_size, path, transport, kind, victim, queue, done, allreduce, fork_child, warm_up,
                 shared_tensors):
    os.environ["TORUS_TRANSPORT"] = transport
    os.environ["TORUS_ALLREDUCE"] = allreduce
    if transport == "auto":
        # Ranks 0 and 1 share a host, rank 2 has one of its own: auto runs shm+tcp.
        os.environ["TORUS_HOST_ID"] = f"host-{rank // 2}"
    import torch_torus  # noqa: F401

    # The timeout is long: a survivor that reports it waited it out has failed.
    dist.init_process_group("torus", init_method="file://" + path, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    if warm_up:
        _run_kind(kind, rank, world_size, shared_tensors)
        # A sender's call may end before its bytes arrive (an eager send ends when the fabric
        # took them): the victim dies only once every survivor has finished warming up, told
        # through the store, which the kill does not touch.
        store = dist.distributed_c10d._get_default_store()
        if rank == victim:
            store.wait([f"warm/{r}" for r in range(world_size) if r != victim])
        else:
            store.set(f"warm/{rank}", "1")
    if rank == victim:
        if fork_child and os.fork() == 0:
            # A DataLoader worker, say: it outlives the rank and must not keep its connections.
            time.sleep(60)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        _run_kind(kind, rank, world_size, shared_tensors)
        queue.put((rank, "returned", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - start))
    try:
        # Later calls fail fast too.
        start = time.monotonic()
        dist.all_reduce(torch.ones(4))
        queue.put((rank, "later call returned", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001
        queue.put((rank, f"later: {type(e).__name__}: {e}", time.monotonic() - start))
    done.wait(60)
    dist.destroy_process_group()


KINDS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather", "reduce", "barrier",
         "send_recv"]


@pytest.mark.parametrize("kind", KINDS)
def test_killed_rank_fails_the_others(backend, tmp_path, kind):
    _killed_rank_fails_the_others(tmp_path, _transports(backend), kind, victim=2)


@pytest.mark.parametrize("victim", [1, 2])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "barrier"])
def test_killed_rank_fails_the_others_across_hosts(tmp_path, kind, victim):
    """shm+tcp: a dead rank on this host (1, seen by its pidfd) or on another (2, by TCP)."""
    _killed_rank_fails_the_others(tmp_path, "auto", kind, victim)


@pytest.mark.parametrize("allreduce", ["ring", "one_shot", "two_shot"])
def test_killed_rank_fails_the_others_in_each_shm_allreduce(tmp_path, allreduce):
    """The shared-memory allreduces wait on postings and deliveries, not messages: a dead rank
    must fail those waits too."""
    _killed_rank_fails_the_others(tmp_path, "shm", "all_reduce", victim=2, allreduce=allreduce)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_killed_rank_fails_the_others_on_shared_tensors(tmp_path, kind):
    """Tensors from allocate_tensor: the survivors map the dead rank's and read and write them
    directly (two_shot, the direct gathers); its death must still fail them, not hang them."""
    _killed_rank_fails_the_others(tmp_path, "shm", kind, victim=2, allreduce="two_shot", shared_tensors=True)


@pytest.mark.parametrize("kind", ["all_reduce", "send_recv"])
def test_killed_rank_with_a_forked_child_fails_the_others(backend, tmp_path, kind):
    """The dead rank's child (forked after the group was made) lives on: the others must still
    see the rank go at once."""
    _killed_rank_fails_the_others(tmp_path, _transports(backend), kind, victim=2, fork_child=True)


@pytest.mark.parametrize("kind", ["all_reduce", "barrier", "send_recv"])
def test_rank_killed_before_its_first_call_fails_the_others(backend, tmp_path, kind):
    """TCP connects to a peer when first needed: a rank that dies before anyone connected to it
    is still named at once when a peer tries (gloo's lazy connections wait forever, gloo#520)."""
    _killed_rank_fails_the_others(tmp_path, _transports(backend), kind, victim=2, warm_up=False)


def _killed_rank_fails_the_others(tmp_path, transport, kind, victim, allreduce="auto", fork_child=False, warm_up=True,
                                  shared_tensors=False):
    world_size = 3
    context = multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    procs = [context.Process(target=_killed_rank,
                             args=(r, world_size, str(tmp_path / "store"), transport, kind, victim, queue, done,
                                   allreduce, fork_child, warm_up, shared_tensors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        reports = [queue.get(timeout=90) for _ in range(2 * (world_size - 1))]
    finally:
        done.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, outcome, seconds in reports:
        # A rank that needs nothing from the dead one (a broadcast's leaf, a gather's sender)
        # may finish the call it is in; the next one must fail.
        if outcome == "returned":
            continue
        assert "DistBackendError" in outcome, f"rank {rank}: {outcome}"
        assert f"rank {victim}" in outcome, f"rank {rank} does not name the dead rank: {outcome}"
        assert "timed out" not in outcome, f"rank {rank} waited out the timeout: {outcome}"
        assert outcome.startswith("later:") or re.search(TORCH_ERROR_WORDS, outcome), \
            f"rank {rank}: the error lacks the words torch matches (/{TORCH_ERROR_WORDS}/): {outcome}"
        assert seconds < PROMPT_SECONDS, f"rank {rank} took {seconds:.1f}s to notice: {outcome}"
    later = [outcome for _, outcome, _ in reports if outcome.startswith("later:")]
    assert len(later) == world_size - 1, f"some survivor's next call returned: {reports}"


# ------------------------------------------------------------------ no growth over a long run


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _case_no_growth(ctx, calls):
    t = torch.ones(8)
    # Warm up until the peak RSS stops growing: a transport's pools (libfabric's tcp provider
    # grows its own by about 10 MiB over the first 100k calls, then not at all; measured) fill
    # up, a leak never stops. At most calls x 2.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(20):
        for _ in range(calls // 10):
            dist.all_reduce(t)
        grown, peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak, resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss
        if grown < 256:
            break
    fds, rss = _fd_count(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    for _ in range(calls):
        t.fill_(1.0)
        dist.all_reduce(t)
    seconds = time.monotonic() - start
    problems = []
    if not t.eq(ctx.world_size).all():
        problems.append(f"rank {ctx.rank}: wrong result {t.tolist()}")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    if _fd_count() != fds:
        problems.append(f"rank {ctx.rank}: fds went from {fds} to {_fd_count()} over {calls} collectives")
    # Peak RSS (KiB on Linux): a leak of even 40 bytes per call would show as 4 MiB here.
    if grown_kib > 4096:
        problems.append(f"rank {ctx.rank}: peak RSS grew {grown_kib} KiB over {calls} collectives")
    print(f"rank {ctx.rank}: {calls} all_reduce calls in {seconds:.1f}s, peak RSS +{grown_kib} KiB, fds {fds}")
    return problems


def test_no_growth_over_100k_collectives(backend):
    _transports(backend)
    harness.check(backend, 2, _case_no_growth, 100_000, timeout=300)
