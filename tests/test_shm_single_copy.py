"""The shared-memory transport's single-copy receive (a point-to-point message above 64 KiB read
straight from the sender's buffer with process_vm_readv), when the sender's buffer stops being
its to lend while the receive reads it:

- the sender gives up on its group (abort() from another thread) or is SIGKILLed while the
  receive is copying: the receive fails naming the sender, never succeeds with bytes the sender
  wrote after it gave up;
- the sender frees its buffer while its send runs: the receive fails, and so does the send.

The copy goes a piece (4 MiB) at a time, and a thread that polls its receive (Work.is_completed,
the transport's test()) copies at most one piece per poll; the receiving rank polls, so the
sender's abort or death lands mid-copy by construction, not by timing. Each case runs two fresh
ranks (spawned: one of them dies or breaks its group), bounded by the queue's and joins' timeouts.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import time

import pytest

MiB = 1 << 20
# 128 pieces: a poll every 10 ms leaves the sender over a second to act mid-copy.
LARGE = 512 * MiB
# Above glibc's largest mmap threshold (32 MiB): freeing it unmaps it.
FREED = 64 * MiB
TAG = 5
SENT, WRITTEN_AFTER = 7, 9


def _wait_for_file(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _touch(path: str) -> None:
    open(path, "w").close()


def _process_ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _sender_gives_up(scratch: str, how: str) -> list:
    import threading

    import torch
    import torch.distributed as dist

    payload = torch.full((LARGE,), SENT, dtype=torch.uint8)
    _touch(os.path.join(scratch, f"pid-{os.getpid()}"))
    work = dist.isend(payload, 1, tag=TAG)
    if not _wait_for_file(os.path.join(scratch, "copying"), 60):
        return ["rank 1 never reported that its receive was copying"]
    if how == "kill":
        _touch(os.path.join(scratch, "dying"))
        os.kill(os.getpid(), signal.SIGKILL)

    def give_up():
        dist.group.WORLD._get_backend(torch.device("cpu")).abort()
        # What a program does with a buffer once its send failed: the receive must not see it.
        payload.fill_(WRITTEN_AFTER)
        _touch(os.path.join(scratch, "gave-up"))

    thread = threading.Thread(target=give_up)
    thread.start()
    problems = []
    try:
        work.wait()
        problems.append("rank 0's send completed although its group was aborted")
    except Exception:  # noqa: BLE001 - the send fails with the group; what it says is rank 0's own
        pass
    thread.join(60)
    return problems


def _receiver_while_sender_gives_up(scratch: str, how: str) -> list:
    import torch
    import torch.distributed as dist

    received = torch.zeros(LARGE, dtype=torch.uint8)
    work = dist.irecv(received, 0, tag=TAG)
    # Each poll copies at most one piece: poll until the first has landed.
    deadline = time.monotonic() + 60
    while received[0].item() != SENT:
        if work.is_completed() or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    if work.is_completed():
        try:
            work.wait()
            return [f"the {LARGE // MiB} MiB receive completed with the poll that began its copy: it was not "
                    "copied a piece at a time"]
        except Exception as error:  # noqa: BLE001
            return [f"the receive failed before rank 0 gave up: {error}"]
    _touch(os.path.join(scratch, "copying"))
    sender_pid = int(next(name for name in os.listdir(scratch) if name.startswith("pid-"))[4:])

    def sender_gone() -> bool:
        if how == "kill":
            return os.path.exists(os.path.join(scratch, "dying")) and _process_ended(sender_pid)
        return os.path.exists(os.path.join(scratch, "gave-up"))

    # Polls keep copying, a piece each, until rank 0 has given up or died.
    landed_mid_copy = False
    while time.monotonic() < deadline:
        if sender_gone():
            landed_mid_copy = True
            break
        if work.is_completed():
            break
        time.sleep(0.01)
    problems = []
    try:
        work.wait()
    except Exception as error:  # noqa: BLE001
        text = str(error)
        if "DistBackendError" not in type(error).__name__:
            problems.append(f"the receive failed with {type(error).__name__}: {text}")
        if "rank 0" not in text:
            problems.append(f"the receive's error does not name rank 0, the sender: {text}")
        return problems
    if landed_mid_copy:
        problems.append(f"the receive succeeded although rank 0 {'died' if how == 'kill' else 'gave up'} "
                        "mid-copy")
    wrong = int((received != SENT).sum())
    if wrong:
        problems.append(f"the receive succeeded with {wrong} bytes that are not what rank 0 sent")
    return problems


def _case_sender_gives_up_mid_copy(rank: int, scratch: str, how: str) -> list:
    if rank == 0:
        return _sender_gives_up(scratch, how)
    return _receiver_while_sender_gives_up(scratch, how)


def _case_sender_frees_its_buffer(rank: int, scratch: str) -> list:
    """Rank 1's receive is left to the transport's helper thread until rank 0's send has ended:
    rank 1's own failure (which gives up on the group once waited for) tells rank 0 nothing."""
    import torch
    import torch.distributed as dist

    freed, send_ended = os.path.join(scratch, "freed"), os.path.join(scratch, "send-ended")
    if rank == 0:
        payload = torch.full((FREED,), SENT, dtype=torch.uint8)
        work = dist.isend(payload, 1, tag=TAG)
        payload.untyped_storage().resize_(0)
        _touch(freed)
        problems = []
        try:
            work.wait()
            problems.append("rank 0's send succeeded although rank 1 could not read its freed buffer")
        except Exception as error:  # noqa: BLE001
            text = str(error)
            if "rank 1 could not read this rank's buffer" not in text or "cannot read rank 0's memory" not in text:
                problems.append(f"rank 0's send failed without saying that rank 1 could not read its buffer: {text}")
        _touch(send_ended)
        return problems
    if not _wait_for_file(freed, 60):
        return ["rank 0 never reported that it freed its buffer"]
    received = torch.zeros(FREED, dtype=torch.uint8)
    work = dist.irecv(received, 0, tag=TAG)
    if not _wait_for_file(send_ended, 60):
        return ["rank 0's send never ended"]
    try:
        work.wait()
        return ["the receive from a freed buffer succeeded"]
    except Exception as error:  # noqa: BLE001
        if "cannot read rank 0's memory" not in str(error):
            return [f"the receive's error does not say that rank 0's memory could not be read: {error}"]
        return []


def _case_small_message_during_a_long_copy(rank: int, scratch: str) -> list:
    """Rank 0 sends 1 GiB and then 4 bytes on another tag; rank 1 waits for the small one first.
    The large one's copy goes a piece at a time with the lock released, so the small one, next
    in the ring, is received while most of the large one is still to copy."""
    import torch
    import torch.distributed as dist

    if rank == 0:
        large = torch.full((2 * LARGE,), SENT, dtype=torch.uint8)
        work = dist.isend(large, 1, tag=TAG)
        dist.send(torch.full((4,), 3, dtype=torch.int32), 1, tag=TAG + 1)
        work.wait()
        return []
    received = torch.zeros(2 * LARGE, dtype=torch.uint8)
    small = torch.zeros(4, dtype=torch.int32)
    work = dist.irecv(received, 0, tag=TAG)
    dist.recv(small, 0, tag=TAG + 1)
    problems = []
    if received[-1].item() == SENT:
        problems.append(f"the {2 * LARGE // MiB} MiB message sent first was all copied before the small one "
                        "behind it was received")
    if small.tolist() != [3] * 4:
        problems.append(f"the small message holds {small.tolist()}")
    work.wait()
    wrong = int((received != SENT).sum())
    if wrong:
        problems.append(f"the large message has {wrong} wrong bytes")
    return problems


def _rank_main(rank, store, scratch, queue, case, args):
    os.environ["TORUS_TRANSPORT"] = "shm"
    import torch.distributed as dist

    import torch_torus  # noqa: F401

    dist.init_process_group("torus", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        queue.put((rank, case(rank, scratch, *args)))
    except Exception as error:  # noqa: BLE001 - reported to the test
        queue.put((rank, [f"{type(error).__name__}: {error}"]))
    dist.destroy_process_group()


def _run_pair(tmp_path, case, *args, dies=None):
    """Runs case(rank, scratch, *args) on two fresh ranks over shm; returns the problems reported
    (a rank that `dies` reports none)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    procs = [context.Process(target=_rank_main, args=(r, str(tmp_path / "store"), str(scratch), queue, case, args))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        reports = [queue.get(timeout=120) for r in range(2) if r != dies]
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return [f"rank {rank}: {problem}" for rank, problems in sorted(reports) for problem in problems]


@pytest.mark.parametrize("how", ["abort", "kill"])
def test_receive_fails_when_the_sender_gives_up_mid_copy(tmp_path, how):
    problems = _run_pair(tmp_path, _case_sender_gives_up_mid_copy, how, dies=0 if how == "kill" else None)
    assert not problems, problems


def test_freed_send_buffer_fails_the_send_and_the_receive(tmp_path):
    problems = _run_pair(tmp_path, _case_sender_frees_its_buffer)
    assert not problems, problems


def test_small_message_is_received_during_a_long_copy(tmp_path):
    problems = _run_pair(tmp_path, _case_small_message_during_a_long_copy)
    assert not problems, problems
