"""Attacks on the wire: a rank that speaks the protocol and lies. The adversary is a real rank of
the group that writes frames of its own onto its TCP connection to the victim (the socket its
transport made, found among the process's descriptors), between the frames its transport
writes, and that dials the victim's listening socket with hellos of its own.

After each attack the victim either gets the right result, or its requests and collectives fail
with a DistBackendError naming the adversary and the field it lied about, promptly; nothing is
written into or past a receive's buffer (receives of exactly their size, which AddressSanitizer
watches: tests/README.md runs this file under it; a sentinel after the buffer at 3 ranks), and
other groups of the same processes still compute right."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
import struct
import time

import pytest
import torch
import torch.distributed as dist

import harness
from reference import first_line
from torch_torus.topology import latest_epoch

BACKEND = "torus+tcp"
# The tag the victim receives on, as its point-to-point wire tag (kP2PTagBase + tag).
TAG = 7
WIRE_TAG = (1 << 62) + TAG
RECV_FLOATS = 1024  # 4096 bytes
SENTINEL = -7.0
# Far below the group's timeout: a check must fail the peer, not a timeout.
PROMPT_SECONDS = 20.0

EAGER, READY_TO_SEND, CLEAR_TO_SEND, DATA, DONE, CREDIT, PROBE, GOODBYE, FAULT = range(1, 10)
HELLO_MAGIC, ACCEPTED, REFUSED = 0x746F7275, 0x6F6B6179, 0x6E6F7065
LIFELINE_MAGIC, FAREWELL_MAGIC, GOODBYE_KIND = 0x6C696665, 0x62796521, 1
# A group whose connections must come within this (a silent connector is closed after it).
SHORT_TIMEOUT = datetime.timedelta(seconds=8)


def _frame(kind, tag=WIRE_TAG, nbytes=0, sequence=0, payload=b"", address=0, key=0):
    """A frame as MessageTransport writes it: the 64-byte WireHeader (tag, nbytes, sequence,
    address, the call signature: kind, dtype, op, algorithm, root, nbytes; kind, reserved, key),
    then the payload. A call of kind 0 agrees with every call."""
    return struct.pack("<QQQQBBBBiQIIQ", tag, nbytes, sequence, address, 0, 0, 0, 0, -1, 0, kind, 0, key) + payload


def _eager_window_frames():
    import torch_torus

    chunk = torch_torus._C.DEFAULT_EAGER_BYTES
    frames = chunk and torch_torus._C.DEFAULT_EAGER_WINDOW // chunk + 1
    # To a tag nobody receives on: each is held, none credited.
    return b"".join(_frame(EAGER, tag=WIRE_TAG + 1, nbytes=chunk, payload=bytes(chunk)) for _ in range(frames))


# Each attack: the bytes the adversary writes (then whether it closes its end), and what the
# victim's error must say.
ATTACKS = {
    "data_longer_than_receive": (
        lambda: _frame(READY_TO_SEND, nbytes=4096, sequence=1) + _frame(DATA, nbytes=8192, sequence=1,
                                                                         payload=b"\xff" * 8192),
        False, ["data frame of 8192 bytes", "for a receive of 4096 bytes"]),
    "data_never_cleared": (
        lambda: _frame(DATA, nbytes=4096, sequence=1, payload=b"\xff" * 4096),
        False, ["data frame of 4096 bytes for send #1", "did not clear to send"]),
    "eager_past_limit": (lambda: _frame(EAGER, nbytes=1 << 40), False, ["eager frame of 1099511627776 bytes",
                                                                          "eager limit"]),
    "eager_past_window": (_eager_window_frames, False, ["past the eager window"]),
    "ready_to_send_past_limit": (
        lambda: b"".join(_frame(READY_TO_SEND, tag=WIRE_TAG + 1, nbytes=4096, sequence=k) for k in range(1, 65538)),
        False, ["with 65536 of its sends already waiting for receives"]),
    "unknown_kind": (lambda: _frame(77), False, ["unknown kind 77"]),
    "huge_credit": (lambda: _frame(CREDIT, sequence=1 << 62), False, ["a credit of 4611686018427387904 eager bytes"]),
    "clear_to_send_unknown": (lambda: _frame(CLEAR_TO_SEND, sequence=99), False,
                              ["clear-to-send for send #99", "waits for no answer"]),
    "done_unknown": (lambda: _frame(DONE, sequence=99), False, ["a done for send #99"]),
    "ready_to_send_out_of_order": (lambda: _frame(READY_TO_SEND, nbytes=4096, sequence=5), False,
                                   ["ready-to-send numbered 5 where #1 was next"]),
    "fault_too_long": (lambda: _frame(FAULT, nbytes=1 << 30), False, ["too long to read", "1073741824 bytes"]),
    "frame_after_goodbye": (
        lambda: _frame(GOODBYE) + _frame(EAGER, nbytes=4096, payload=b"\xff" * 4096),
        False, ["a frame of kind 1 after its goodbye"]),
    "goodbye_then_close": (lambda: _frame(GOODBYE), True, ["rank 1 left the group"]),
    "truncated_header": (lambda: _frame(EAGER, nbytes=4096)[:30], True, ["rank 1 closed its connection"]),
    "truncated_payload": (lambda: _frame(EAGER, nbytes=4096, payload=b"\xff" * 100), True,
                          ["rank 1 closed its connection"]),
}


def _inet_sockets():
    """{fd: (local address, peer address or None)} of this process's TCP sockets."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                try:
                    peer = sock.getpeername()[:2]
                except OSError:
                    peer = None
                found[fd] = (sock.getsockname()[:2], peer)
        finally:
            sock.close()
    return found


def _publish(ctx, name, value):
    path = os.path.join(ctx.scratch, name)
    with open(path + ".tmp", "w") as f:
        f.write(repr(value))
    os.replace(path + ".tmp", path)


def _read_published(ctx, name):
    path = os.path.join(ctx.scratch, name)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} was never published")
        time.sleep(0.01)
    with open(path) as f:
        return eval(f.read())  # noqa: S307 - written by _publish in this test


def _attacked_group(ctx, victim, **options):
    """A new group over every rank (with `options` for new_group), connected (one allreduce),
    with the victim's listening address and connected local addresses published as
    '<name>-listen' and '<name>-local'; the TCP sockets this process made for it."""
    dist.all_reduce(torch.ones(4))  # the default group connects before the count
    before = _inet_sockets()
    group = ctx.new_group(list(range(ctx.world_size)), **options)
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    assert t.eq(ctx.world_size).all(), t
    made = {fd: v for fd, v in _inet_sockets().items() if fd not in before}
    run = ctx.state["attack"] = ctx.state.get("attack", 0) + 1
    if ctx.rank == victim:
        _publish(ctx, f"{run}-listen", [local for local, peer in made.values() if peer is None])
        _publish(ctx, f"{run}-local", [local for local, peer in made.values() if peer is not None])
    return group, made, run


def _stream_to(ctx, made, run):
    """The adversary's connected socket (its transport's) to the victim."""
    victim_local = set(_read_published(ctx, f"{run}-local"))
    # A dial the victim refused (both ranks dialed at once) closes once its verdict is read.
    deadline = time.monotonic() + 10
    while True:
        now = _inet_sockets()
        fds = [fd for fd, (local, peer) in made.items() if peer in victim_local and now.get(fd) == (local, peer)]
        if len(fds) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(fds) == 1, (made, victim_local)
    stream = socket.socket(fileno=os.dup(fds[0]))
    stream.settimeout(30)  # the descriptor stays non-blocking: it is the transport's
    return stream


def _fails(what, call, expected, adversary):
    """Problems unless `call` raises, promptly, a DistBackendError naming the adversary and
    saying each of `expected`."""
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is checked
        text = str(error)
        problems = [] if isinstance(error, dist.DistBackendError) else [
            f"{what}: {type(error).__name__}, not DistBackendError: {first_line(error)}"]
        problems += [f"{what}: the error does not say {want!r}: {text[:600]}"
                     for want in [f"rank {adversary}", *expected] if want not in text]
    else:
        problems = [f"{what}: the attack went unnoticed: it completed"]
    if time.monotonic() - start > PROMPT_SECONDS:
        problems.append(f"{what}: took {time.monotonic() - start:.1f}s to fail (waited out a timeout?)")
    return problems


def _receive_fails(work, expected, adversary):
    return _fails("the receive", lambda: work.wait(timeout=datetime.timedelta(seconds=PROMPT_SECONDS)), expected,
                  adversary)


def _collective_fails(group, adversary):
    return _fails("the group's allreduce after the attack", lambda: dist.all_reduce(torch.ones(4), group=group), [],
                  adversary)


def _attack_fails(group, work, buffer, expected, adversary):
    """Problems unless the receive `work` (into `buffer`, left untouched) fails promptly naming the
    adversary and saying each of `expected`, and then so does the group's collective."""
    problems = _receive_fails(work, expected, adversary)
    if not buffer.eq(SENTINEL).all():
        problems.append("the failed receive's buffer was written")
    return problems + _collective_fails(group, adversary)


def _received(work, buffer, data, after):
    """Problems unless `work`, a receive into the first data.numel() elements of `buffer`, completes
    with `data`, the rest of `buffer` (a sentinel) untouched."""
    n = data.numel()
    try:
        work.wait(timeout=datetime.timedelta(seconds=60))
    except Exception as error:  # noqa: BLE001 - any error is a problem here
        return [f"the receive failed after {after}: {first_line(error)}"]
    if not buffer[:n].equal(data) or not buffer[n:].eq(SENTINEL).all():
        return [f"the receive after {after} got the wrong data"]
    return []


def _default_group_right(ctx):
    """Another group of the same processes is untouched."""
    t = torch.full((1000,), float(ctx.rank + 1))
    dist.all_reduce(t)
    want = sum(range(1, ctx.world_size + 1))
    return [] if t.eq(want).all() else [f"the default group's allreduce gave {t[:4].tolist()}, not {want}"]


def _case_attack(ctx, attack):
    adversary, victim = 1, 0
    group, made, run = _attacked_group(ctx, victim)
    problems = []
    if ctx.rank == adversary:
        write, close, _ = ATTACKS[attack]
        stream = _stream_to(ctx, made, run)
        dist.barrier()  # the victim has posted its receive
        stream.sendall(write())
        if close:
            stream.shutdown(socket.SHUT_WR)
        stream.close()
        dist.barrier()  # the victim has looked
    else:
        _, _, expected = ATTACKS[attack]
        # Exactly the receive's size: under AddressSanitizer a byte past it is reported.
        buffer = torch.full((RECV_FLOATS,), SENTINEL)
        work = dist.irecv(buffer, src=adversary, tag=TAG, group=group)
        dist.barrier()
        problems += _receive_fails(work, expected, adversary)
        # A well-formed eager frame cut short writes its first bytes into the receive's own buffer
        # before the close fails it; no other attack gets a byte in.
        if attack != "truncated_payload" and not buffer.eq(SENTINEL).all():
            problems.append("the failed receive's buffer was written")
        problems += _collective_fails(group, adversary)
        dist.barrier()
    dist.destroy_process_group(group)
    return problems + _default_group_right(ctx)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_forged_frame_fails_only_its_sender(attack):
    harness.check(BACKEND, 2, _case_attack, attack, timeout=90)


def _group_store(group):
    """The store the group's torus backend keeps its keys under (torus/<epoch>/, below the
    prefixes torch gives the group and its device): every rank of the group can read it, and in
    it the group's secret (docs/security.md)."""
    c10d = dist.distributed_c10d
    store = dist.PrefixStore(f"{c10d._get_process_group_name(group)}/", c10d._get_default_store())
    for device in ("cpu", "cuda"):
        backend_store = dist.PrefixStore(f"{device}/", store)
        epoch = latest_epoch(backend_store)
        if epoch is not None:
            return dist.PrefixStore(f"torus/{epoch}", backend_store)
    raise AssertionError("the group's torus keys are not in the store")


def _proof(secret, purpose, sender, receiver, nonce, carried=b""):
    """What a hello of `purpose` from `sender` to `receiver` proves the group's secret with
    (csrc/transport/group_secret.cc)."""
    message = purpose + b"\0" + struct.pack("<ii", sender, receiver) + nonce + carried
    return hmac.new(secret, message, hashlib.sha256).digest()


def _hello(secret, rank, size, to, magic=HELLO_MAGIC, purpose=b"torus tcp hello", proof=None, nonce=None):
    """A hello as the TCP transport (or, with their magic and purpose, the lifelines) write it:
    magic, rank, size, a nonce and its proof."""
    nonce = nonce or os.urandom(16)
    proof = _proof(secret, purpose, rank, to, nonce) if proof is None else proof
    return struct.pack("<Iii16s32s", magic, rank, size, nonce, proof)


def _answer(sock, nbytes):
    """The first `nbytes` the victim answers on `sock`, or None when it closed unanswered."""
    answer = b""
    while len(answer) < nbytes:
        got = sock.recv(nbytes - len(answer))
        if not got:
            return None
        answer += got
    return answer


def _knock(where, hello, nbytes):
    """Connects to `where`, says `hello`, returns the first `nbytes` of the answer (None: closed
    unanswered)."""
    with socket.create_connection(where, timeout=30) as sock:
        sock.sendall(hello)
        return _answer(sock, nbytes)


def _silence_closed(where):
    """Problems unless a connection to `where` that never says hello is closed by the victim (the
    group's timeout for connections is SHORT_TIMEOUT)."""
    with socket.create_connection(where, timeout=30) as sock:
        try:
            got = sock.recv(1)
        except TimeoutError:
            return ["a connection that never said hello was still open after 30 s"]
    return [] if got == b"" else [f"a connection that never said hello was answered {got!r}"]


def _stderr_size():
    return os.fstat(2).st_size


def _turned_away_since(offset, expected, kind):
    """Problems unless this process's stderr (the harness's log file), from `offset` on, warns of
    `expected` connections of `kind` turned away, each naming the address it came from."""
    with open("/proc/self/fd/2", "rb") as f:
        f.seek(offset)
        lines = [line for line in f.read().decode(errors="replace").splitlines()
                 if f"warning: turned away a {kind} from 127.0.0.1:" in line]
    if len(lines) == expected and lines[-1].endswith(f"{expected} turned away so far"):
        return []
    return [f"{len(lines)} warnings of a {kind} turned away, expected {expected}: {lines}"]


def _forged_hellos(secret, adversary, victim, magic, purpose):
    """(what, hello) pairs that must all be turned away unanswered: forged, unproven or replayed
    hellos, the replayed one after a valid hello of the same bytes."""
    def hello(**kw):
        return _hello(secret, kw.pop("rank", adversary), kw.pop("size", 2), victim, magic, purpose, **kw)

    nonce = os.urandom(16)
    return hello(nonce=nonce), [
        ("the same hello again (replayed)", hello(nonce=nonce)),
        ("a hello as the victim itself", hello(rank=victim)),
        ("a hello as rank 5 of 2", hello(rank=5)),
        ("a hello as rank -1", hello(rank=-1)),
        ("a hello of another group's size", hello(size=3)),
        ("a hello without a proof", hello(proof=bytes(32))),
        ("a hello proven with another secret", _hello(os.urandom(32), adversary, 2, victim, magic, purpose)),
        ("a hello proven for another receiver", _hello(secret, adversary, 2, 2, magic, purpose)),
        ("a hello proven for another transport", hello(proof=_proof(secret, b"torus fabric hello", adversary, victim,
                                                                   nonce))),
        ("bytes that are no hello", os.urandom(60)),
    ]


def _case_hellos(ctx):
    adversary, victim = 1, 0
    group, made, run = _attacked_group(ctx, victim, timeout=SHORT_TIMEOUT)
    problems = []
    data = torch.arange(RECV_FLOATS, dtype=torch.float32)
    if ctx.rank == adversary:
        listen = _read_published(ctx, f"{run}-listen")[0]
        secret = bytes(_group_store(group).get("auth/secret"))
        dist.barrier()
        # A valid hello as rank 1, which is connected already: refused (its proof is right).
        valid, forged = _forged_hellos(secret, adversary, victim, HELLO_MAGIC, b"torus tcp hello")
        got = _knock(listen, valid, 40)
        if got is None or struct.unpack("<I", got[:4])[0] != REFUSED:
            problems.append(f"a second valid hello as rank 1 was answered {got!r}, not refused")
        for what, hello in forged:
            got = _knock(listen, hello, 40)
            if got is not None:
                problems.append(f"{what} was answered {got!r}: it must be closed unanswered")
        problems += _silence_closed(listen)
        dist.send(data, victim, tag=TAG, group=group)
        dist.barrier()
    else:
        buffer = torch.full((2 * RECV_FLOATS,), SENTINEL)
        work = dist.irecv(buffer[:RECV_FLOATS], src=adversary, tag=TAG, group=group)
        logged = _stderr_size()
        dist.barrier()
        problems += _received(work, buffer, data, "forged hellos")
        # Every forged hello, and the silent connection.
        problems += _turned_away_since(logged, 11, "TCP connection")
        dist.barrier()
    t = torch.full((1000,), float(ctx.rank + 1))
    dist.all_reduce(t, group=group)
    if not t.eq(3.0).all():
        problems.append(f"the attacked group's allreduce gave {t[:4].tolist()} after forged hellos")
    dist.destroy_process_group(group)
    return problems


def test_forged_hellos_never_become_a_rank():
    harness.check(BACKEND, 2, _case_hellos, timeout=90)


def _case_bystander(ctx):
    """Three ranks: rank 2 forges a data frame to rank 0; ranks 0 and 1 fail the group's next
    collective naming rank 2."""
    adversary, victim = 2, 0
    group, made, run = _attacked_group(ctx, victim)
    problems = []
    if ctx.rank == adversary:
        stream = _stream_to(ctx, made, run)
        dist.barrier()
        stream.sendall(_frame(READY_TO_SEND, nbytes=4096, sequence=1) +
                       _frame(DATA, nbytes=8192, sequence=1, payload=b"\xff" * 8192))
        stream.close()
        dist.barrier()
    else:
        buffer = torch.full((2 * RECV_FLOATS,), SENTINEL)
        work = dist.irecv(buffer[:RECV_FLOATS], src=adversary, tag=TAG, group=group) if ctx.rank == victim else None
        dist.barrier()
        if work is not None:
            problems += _receive_fails(work, ["for a receive of 4096 bytes"], adversary)
            if not buffer[RECV_FLOATS:].eq(SENTINEL).all():
                problems.append("bytes were written past the receive's buffer")
        # Rank 2 stays out: the two others fail, rank 1 told by rank 0.
        problems += _collective_fails(group, adversary)
        dist.barrier()
    dist.destroy_process_group(group)
    return problems + _default_group_right(ctx)


def test_a_forged_frame_fails_the_group_for_every_rank():
    harness.check(BACKEND, 3, _case_bystander, timeout=90)


# The shared-memory transport's inbound ring from rank p in rank r's segment (shm_transport.cc,
# for a small group): a page of control block, postings and delivery counts, two 512 KiB
# one-shot slots, then one ring per rank, each a 64-byte line apiece for its head, tail and flag,
# then the data; the head counts the bytes the producer wrote, ever.
RING_BYTES = 512 * 1024
RINGS_OFFSET = 4096 + 2 * 512 * 1024
SHARED_RING_BYTES = 3 * 64 + RING_BYTES


def _segment_mappings():
    """{(start, end): path} of this process's mappings of torus shared-memory segments."""
    found = {}
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "memfd:torus-rank" in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found[(start, end)] = fields[5].strip()
    return found


def _case_ring_head(ctx):
    """Over shared memory the wire is the ring in the victim's segment: rank 1 moves its ring's
    head past what the ring holds, and rank 0 fails it, naming the field, instead of copying from
    past the ring."""
    import ctypes

    adversary, victim = 1, 0
    dist.all_reduce(torch.ones(4))
    before = _segment_mappings()
    group = ctx.new_group([0, 1])
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    problems = []
    if ctx.rank == adversary:
        victims = [(start, end) for (start, end), path in _segment_mappings().items()
                   if (start, end) not in before and f"torus-rank{victim}" in path]
        assert len(victims) == 1, victims
        start, end = victims[0]
        head = start + RINGS_OFFSET + adversary * SHARED_RING_BYTES
        dist.barrier()
        ctypes.c_uint64.from_address(head).value += 4 * RING_BYTES
        dist.barrier()
    else:
        buffer = torch.full((2 * RECV_FLOATS,), SENTINEL)
        work = dist.irecv(buffer[:RECV_FLOATS], src=adversary, tag=TAG, group=group)
        dist.barrier()
        problems += _receive_fails(work, ["ring's head is at byte"], adversary)
        if not buffer[RECV_FLOATS:].eq(SENTINEL).all():
            problems.append("bytes were written past the receive's buffer")
        dist.barrier()
    dist.destroy_process_group(group)
    return problems + _default_group_right(ctx)


def test_a_forged_ring_head_fails_only_its_writer():
    harness.check("torus+shm", 2, _case_ring_head, timeout=90)


def _second_lifeline(group, adversary, victim):
    """A lifeline of the adversary's own to the victim, made with a valid hello (the adversary is
    a rank of the group: it knows the secret), and the victim's answer to it."""
    store = _group_store(group)
    secret = bytes(store.get("auth/secret"))
    host, port = bytes(store.get(f"ofi/{victim}")).decode().split(" ")[0].rsplit(":", 1)
    where = (host.strip("[]"), int(port))
    valid, forged = _forged_hellos(secret, adversary, victim, LIFELINE_MAGIC, b"torus lifeline hello")
    line = socket.create_connection(where, timeout=30)
    line.sendall(valid)
    got = _answer(line, 32)
    problems = [] if got == _proof(secret, b"torus lifeline accept", victim, adversary, valid[12:28]) else [
        f"a valid lifeline hello was answered {got!r}, not with the victim's proof"]
    return line, where, forged, problems


def _case_lifeline_hellos(ctx):
    """Over OFI, the lifelines: a valid hello is answered with the victim's proof over its nonce;
    the same hello again and every forged one are closed unanswered, as is a connection that never
    says hello; each is reported; the group still computes right."""
    adversary, victim = 1, 0
    group = ctx.new_group([0, 1], timeout=SHORT_TIMEOUT)
    dist.all_reduce(torch.ones(4), group=group)  # the streams and lifelines are made
    problems, held = [], None
    if ctx.rank == adversary:
        dist.barrier()
        # Held open until the group is gone: the victim takes a lifeline's close for its peer's death.
        held, where, forged, problems = _second_lifeline(group, adversary, victim)
        for what, hello in forged:
            got = _knock(where, hello, 1)
            if got is not None:
                problems.append(f"{what} on a lifeline was answered {got!r}: it must be closed unanswered")
        problems += _silence_closed(where)
        dist.barrier()
    else:
        logged = _stderr_size()
        dist.barrier()
        dist.barrier()
        problems += _turned_away_since(logged, 11, "lifeline connection")
    t = torch.full((1000,), float(ctx.rank + 1))
    dist.all_reduce(t, group=group)
    if not t.eq(3.0).all():
        problems.append(f"the attacked group's allreduce gave {t[:4].tolist()} after forged lifeline hellos")
    dist.destroy_process_group(group)
    if held is not None:
        held.close()
    return problems + _default_group_right(ctx)


@pytest.mark.skipif(bool(harness.without_ofi()), reason=str(harness.without_ofi()))
def test_forged_lifeline_hellos_never_become_a_rank():
    harness.check("torus+ofi", 2, _case_lifeline_hellos, env={"TORUS_OFI_PROVIDER": "tcp"}, timeout=90)


# A farewell's counts that cannot be: (stream bytes, read bytes), and what the victim's error says.
FAREWELL_LIES = {
    "read_more_than_sent": (1 << 41, 1 << 40, ["read count says it read 1099511627776 bytes"]),
    "wrote_less_than_read": (0, 0, ["stream count says it wrote 0 bytes"]),
}


def _case_forged_farewell(ctx, lie):
    """Over OFI, a goodbye on a lifeline whose counts cannot be: the victim fails the adversary,
    naming it and the count, and writes nothing into its receive."""
    adversary, victim = 1, 0
    group = ctx.new_group([0, 1], timeout=SHORT_TIMEOUT)
    dist.all_reduce(torch.ones(RECV_FLOATS), group=group)  # the streams carried bytes each way
    stream_bytes, read_bytes, expected = FAREWELL_LIES[lie]
    problems, held = [], None
    if ctx.rank == adversary:
        held, _, _, problems = _second_lifeline(group, adversary, victim)
        dist.barrier()  # the victim has posted its receive
        held.sendall(struct.pack("<IIQQII", FAREWELL_MAGIC, GOODBYE_KIND, stream_bytes, read_bytes, 0, 0))
        dist.barrier()
    else:
        buffer = torch.full((RECV_FLOATS,), SENTINEL)
        work = dist.irecv(buffer, src=adversary, tag=TAG, group=group)
        dist.barrier()
        problems += _attack_fails(group, work, buffer, expected, adversary)
        dist.barrier()
    dist.destroy_process_group(group)
    if held is not None:
        held.close()
    return problems + _default_group_right(ctx)


@pytest.mark.skipif(bool(harness.without_ofi()), reason=str(harness.without_ofi()))
@pytest.mark.parametrize("lie", list(FAREWELL_LIES))
def test_a_forged_farewell_fails_only_its_sender(lie):
    harness.check("torus+ofi", 2, _case_forged_farewell, lie, env={"TORUS_OFI_PROVIDER": "tcp"}, timeout=90)


def _case_impostor(ctx):
    """A process that took over a peer's published address (the store, which is trusted, points
    the dialing rank there) answers the hello with an acceptance it cannot prove: the dialing rank
    fails that peer, saying so, rather than take the impostor's socket for it."""
    import threading

    impostor_of, dialer = 0, 1
    group = ctx.new_group([0, 1], timeout=SHORT_TIMEOUT)
    problems = []
    if ctx.rank == impostor_of:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(30)

        def accept_unproven():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                return
            with sock:
                sock.settimeout(30)
                if _answer(sock, 60) is not None:
                    sock.sendall(struct.pack("<II32s", ACCEPTED, 0, bytes(32)))
                    _answer(sock, 1)  # until the dialer closes it

        thread = threading.Thread(target=accept_unproven, daemon=True)
        thread.start()
        _group_store(group).set(f"tcp/{impostor_of}", f"127.0.0.1:{listener.getsockname()[1]}")
        dist.barrier()
        dist.barrier()
        thread.join(timeout=30)
        listener.close()
    else:
        dist.barrier()  # the address is the impostor's
        problems += _fails("a send to the impersonated rank",
                           lambda: dist.send(torch.ones(4), impostor_of, tag=TAG, group=group),
                           ["did not prove it belongs to the group"], impostor_of)
        dist.barrier()
    dist.destroy_process_group(group)
    return problems + _default_group_right(ctx)


def test_an_impostor_at_a_peers_address_is_not_taken_for_it():
    harness.check(BACKEND, 2, _case_impostor, timeout=90)
