"""The OFI transport's kill sweep (issue 39): for each point where the transport waits on a peer,
over libfabric's tcp and shm providers, the peer is SIGKILLed while its survivor waits there. The
survivor fails within the group's timeout plus 5 s, naming the peer; abort() and
destroy_process_group() return; nothing is left in /dev/shm.

No hook in the transport puts a rank at a point: the victim stops itself (SIGSTOP) once what the
survivor will wait for is on its way, the survivor enters the wait, and a timer of the survivor's
kills the stopped victim while it waits:

* rma-read: the victim announces a 4 MiB message lent for an RMA read (TORUS_OFI_RMA_BYTES=64K)
  and stops; the survivor's receive reads the victim's memory. rma-read-dead: the victim is dead
  before the read starts.
* credit-wait: the survivor sends 2 MiB of eager messages to the stopped victim, whose 32 receive
  slots (1 MiB) fill: the rest waits for credits.
* chunk-post: the victim is dead; the survivor's next collective posts chunks to it at once.
* farewell: the survivor destroys its group while its goodbye waits behind chunks the stopped
  victim never takes. abort: the same after abort().

And a peer that destroys its group in the middle of a message, whose goodbye comes on its
lifeline alone, has left the group: its receiver does not take it for a crash.

Each rank is a process of its own (spawned: a killed rank must not take a pool down), bounded by
timeouts on every wait. Skips, saying why, without libfabric.
"""

from __future__ import annotations

import datetime
import glob
import multiprocessing
import os
import signal
import threading
import time

import pytest

import harness

if harness.without_ofi():
    pytest.skip(harness.without_ofi(), allow_module_level=True)

GROUP_TIMEOUT = 10.0
# How long the survivor waits at its point before the victim is killed.
KILL_AFTER = 1.0
# Bounds starting both ranks (importing torch, making the group) and the survivor's first step.
STARTUP = 120.0
POINTS = ["rma-read", "rma-read-dead", "credit-wait", "chunk-post", "farewell", "abort"]


def _state(pid: int) -> str:
    """The process's state letter (R, S, T, Z, ...), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def _await_state(pid: int, states: str, seconds: float = 10.0) -> None:
    until = time.monotonic() + seconds
    while _state(pid) not in states:
        if time.monotonic() > until:
            raise RuntimeError(f"process {pid} never reached state {states!r} (it is {_state(pid)!r})")
        time.sleep(0.01)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _start(target, path, *args):
    """Two spawned ranks running target(rank, path, *args, queue), and the queue they report on."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=target, args=(r, path, *args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    return procs, queue


def _reap(procs) -> None:
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


def _rank(rank, path, provider, point, queue):
    os.environ.update(TORUS_TRANSPORT="ofi", TORUS_OFI_PROVIDER=provider,
                      TORUS_OFI_RMA_BYTES="64K" if point.startswith("rma-read") else "64M")
    import torch
    import torch.distributed as dist
    import torch_torus  # noqa: F401

    dist.init_process_group("torus", init_method="file://" + path, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    pids = torch.zeros(2, dtype=torch.int64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)  # both streams made, both ways
    victim = int(pids[1])
    if rank == 1:
        if point.startswith("rma-read"):
            dist.isend(torch.ones(1 << 20), dst=0, tag=1)
            dist.isend(torch.ones(4), dst=0, tag=2).wait()  # the announcement went out before it
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)  # never reached: the survivor kills this rank
        return

    def report(what, start, error=None):
        queue.put((what, f"{type(error).__name__}: {error}" if error else "returned", time.monotonic() - start))

    _await_state(victim, "T")
    if point in ("rma-read-dead", "chunk-post"):
        _kill(victim)
        _await_state(victim, "Z")
    else:
        threading.Timer(KILL_AFTER, _kill, (victim,)).start()
    start = time.monotonic()
    try:
        if point.startswith("rma-read"):
            got = torch.empty(1 << 20)
            dist.recv(got, src=1, tag=1)
            if not got.eq(1).all():
                raise AssertionError("the read returned wrong data")
        elif point == "credit-wait":
            for work in [dist.isend(torch.ones(1 << 17), dst=1, tag=3) for _ in range(4)]:
                work.wait()
        elif point == "chunk-post":
            dist.all_reduce(torch.ones(1 << 16))
        else:
            for _ in range(4):
                dist.isend(torch.ones(1 << 17), dst=1, tag=3)
            time.sleep(KILL_AFTER / 2)  # the chunks are out, the victim's slots full
    except Exception as e:  # noqa: BLE001 - reported to the test
        report("wait", start, e)
    else:
        report("wait", start)
    if point in ("rma-read", "rma-read-dead", "credit-wait", "chunk-post"):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as e:  # noqa: BLE001
            report("later", start, e)
        else:
            report("later", start)
    if point != "farewell":
        start = time.monotonic()
        dist.group.WORLD._get_backend(torch.device("cpu")).abort()
        report("abort", start)
    start = time.monotonic()
    dist.destroy_process_group()
    report("destroy", start)


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_peer_killed_at_each_wait(tmp_path, provider, point):
    procs, queue = _start(_rank, str(tmp_path / "store"), provider, point)
    reports = {}
    try:
        while "destroy" not in reports:
            # Startup (slow on a loaded machine), then the timeout and 5 s at most for each step.
            what, outcome, seconds = queue.get(timeout=STARTUP if not reports else GROUP_TIMEOUT + 5)
            reports[what] = (outcome, seconds)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{provider}/{point}: the survivor hung ({type(e).__name__}); it reported {reports}")
    finally:
        _reap(procs)
    for what, (outcome, seconds) in reports.items():
        assert seconds < GROUP_TIMEOUT + 5, f"{provider}/{point}: {what} took {seconds:.1f} s: {outcome}"
    for what in ("wait", "later"):
        outcome = reports.get(what, ("returned", 0))[0]
        if point in ("farewell", "abort") or (what == "wait" and point == "rma-read" and outcome == "returned"):
            continue  # a read the victim's memory served before it died completes (its data checked)
        assert "DistBackendError" in outcome or "RuntimeError" in outcome, f"{provider}/{point} {what}: {outcome}"
        assert "rank 1" in outcome, f"{provider}/{point} {what}: the error does not name rank 1: {outcome}"
        assert "timed out" not in outcome, f"{provider}/{point} {what}: waited out the timeout: {outcome}"
    assert reports.get("abort", ("returned",))[0] == "returned"
    assert reports["destroy"][0] == "returned"
    left = [name for p in procs for name in glob.glob(f"/dev/shm/torus_{p.pid}_*")]
    for name in left:
        os.unlink(name)
    assert not left, f"{provider}/{point}: left in /dev/shm: {left}"


# ------------------------------------------------------------------ killed after its first message


def _first_contact(rank, path, provider, queue):
    os.environ.update(TORUS_TRANSPORT="ofi", TORUS_OFI_PROVIDER=provider)
    import torch
    import torch.distributed as dist
    import torch_torus  # noqa: F401

    dist.init_process_group("torus", init_method="file://" + path, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    pid_file = path + ".victim"
    if rank == 1:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        dist.isend(torch.ones(4), dst=0, tag=1).wait()  # the group's first message: rank 1 dials
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)  # never reached: the survivor kills this rank
        return
    # From any rank: this rank makes progress for rank 1's first message without dialing it.
    if dist.recv(torch.empty(4), tag=1) != 1:
        raise AssertionError("the first message came from another rank")
    with open(pid_file) as f:
        victim = int(f.read())
    _await_state(victim, "T")
    _kill(victim)
    _await_state(victim, "Z")
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put((f"{type(e).__name__}: {e}", time.monotonic() - start))
    else:
        queue.put(("returned", time.monotonic() - start))
    dist.destroy_process_group()


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_peer_killed_after_its_first_message(tmp_path, provider):
    """The rank that makes first contact dials the lifeline; killed right after its first
    message, before its own progress ran again, its peer still learns that it died: the dialer
    writes its lifeline's hello before it says anything on the fabric."""
    procs, queue = _start(_first_contact, str(tmp_path / "store"), provider)
    try:
        outcome, seconds = queue.get(timeout=STARTUP + GROUP_TIMEOUT + 5)
    finally:
        _reap(procs)
    assert "rank 1" in outcome and "timed out" not in outcome, f"{provider}: {outcome}"
    assert seconds < GROUP_TIMEOUT, f"{provider}: took {seconds:.1f} s: {outcome}"


# ------------------------------------------------------------------ a peer that leaves mid-frame


def _leaver(rank, path, provider, queue):
    os.environ.update(TORUS_TRANSPORT="ofi", TORUS_OFI_PROVIDER=provider, TORUS_OFI_RMA_BYTES="1G")
    import torch
    import torch.distributed as dist
    import torch_torus  # noqa: F401

    dist.init_process_group("torus", init_method="file://" + path, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    count = 256 << 20  # 1 GiB: still streaming when rank 1 leaves (its destroy lingers 1 s at most)
    start = time.monotonic()
    if rank == 1:
        dist.isend(torch.ones(count), dst=0, tag=5)
        time.sleep(0.2)
        dist.destroy_process_group()
        return
    try:
        got = torch.empty(count)
        dist.recv(got, src=1, tag=5)
        whole = bool(torch.all(got == 1))
        queue.put(("returned whole" if whole else "returned torn", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put((f"{type(e).__name__}: {e}", time.monotonic() - start))
    dist.destroy_process_group()


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_peer_that_leaves_mid_message_has_left(tmp_path, provider):
    """A peer that destroys its group in the middle of a message sends no goodbye frame on its
    stream, only on its lifeline: the receive fails saying that it left, not that it crashed."""
    procs, queue = _start(_leaver, str(tmp_path / "store"), provider)
    try:
        outcome, seconds = queue.get(timeout=STARTUP + GROUP_TIMEOUT)
    finally:
        _reap(procs)
    assert outcome != "returned torn", "the receive of a message its sender left in the middle of returned"
    if outcome != "returned whole":  # else the leaver's farewell delivered the rest first, as it may
        assert "rank 1 left the group" in outcome, f"{provider}: the leaver is not named as leaving: {outcome}"
    assert seconds < GROUP_TIMEOUT + 5, f"{provider}: took {seconds:.1f} s: {outcome}"


# ------------------------------------------------------------------ a read waits without the lock


def _reader(rank, path, provider, queue):
    os.environ.update(TORUS_TRANSPORT="ofi", TORUS_OFI_PROVIDER=provider, TORUS_OFI_RMA_BYTES="64K")
    import torch
    import torch.distributed as dist
    import torch_torus  # noqa: F401

    dist.init_process_group("torus", init_method="file://" + path, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    pids = torch.zeros(2, dtype=torch.int64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    stopped = int(pids[1])
    if rank == 1:
        lent = dist.isend(torch.arange(1 << 20, dtype=torch.float32), dst=0, tag=1)
        dist.isend(torch.ones(4), dst=0, tag=2).wait()  # the announcement went out before it
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 continues this process
        dist.recv(torch.empty(4), src=0, tag=3)
        lent.wait()
        dist.destroy_process_group()
        return
    _await_state(stopped, "T")
    got = torch.empty(1 << 20)
    failure = []

    def receive():
        try:
            dist.recv(got, src=1, tag=1)
        except Exception as e:  # noqa: BLE001 - reported to the test
            failure.append(f"{type(e).__name__}: {e}")

    reading = threading.Thread(target=receive)
    reading.start()  # its read of rank 1's memory cannot end while rank 1 is stopped
    time.sleep(KILL_AFTER)
    start = time.monotonic()
    dist.isend(torch.full((4,), 7.0), dst=1, tag=3)  # takes the transport's lock
    queue.put(("isend", time.monotonic() - start))
    os.kill(stopped, signal.SIGCONT)
    reading.join(GROUP_TIMEOUT + 5)
    queue.put(("read", "hung" if reading.is_alive() else failure[0] if failure else
               "right" if torch.equal(got, torch.arange(1 << 20, dtype=torch.float32)) else "wrong"))
    dist.destroy_process_group()


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_a_read_from_a_stopped_peer_leaves_the_transport_free(tmp_path, provider):
    """A receive that reads the peer's memory waits for the peer without holding the transport's
    lock: while the peer is stopped, another thread's call on the group goes through, and the
    read ends with the right data once the peer runs again."""
    procs, queue = _start(_reader, str(tmp_path / "store"), provider)
    try:
        reports = dict(queue.get(timeout=STARTUP + GROUP_TIMEOUT) for _ in range(2))
    finally:
        for p in procs:  # a failed run must not leave rank 1 stopped
            if p.pid:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        _reap(procs)
    assert reports["isend"] < KILL_AFTER, f"{provider}: the isend waited {reports['isend']:.1f} s for the read"
    assert reports["read"] == "right", f"{provider}: the read {reports['read']}"
