"""Attacks on the OFI transport's fabric wire, over libfabric's tcp (tcp;ofi_rxm) and shm providers.
The adversary is a libfabric endpoint of its own (torus_testing.OfiAdversary, on the group's
provider, opened in rank 1's process or in a process of its own) that sends the bytes and tags a
test crafts to rank 0's published endpoint:

* as a rank of the group: rank 1 publishes the adversary's endpoint, and a lifeline it answers
  with the group's secret, under its own key of the group's store (which every rank trusts), so
  rank 0's stream to rank 1 is the adversary's. It then sends chunks holding forged frames,
  credit words too large or of the wrong size, chunks longer than a slot, messages under tags
  nobody receives, a frame cut short before its lifeline ends, and farewells that lie;
* as an outsider that never said a proven hello: forged and replayed fabric hellos, and chunks
  and credit words tagged as rank 1.

After each attack the victim either gets the right result, or its receive and the group's
collectives fail promptly with a DistBackendError naming the adversary and the field it lied
about; nothing is written into the failed receive's buffer, which has exactly the receive's size
(AddressSanitizer watches it: tests/README.md); the default group of the same processes still
computes right. The lifelines' own attacks (forged lifeline hellos, a second lifeline's lying
farewell) are test_wire.py's. Skips, saying why, without libfabric or one of the providers."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import harness
from reference import first_line
from test_wire import (CREDIT, DATA, EAGER, FAREWELL_MAGIC, GOODBYE, GOODBYE_KIND, PROMPT_SECONDS,
                       READY_TO_SEND, RECV_FLOATS, SENTINEL, TAG, WIRE_TAG, _answer, _attack_fails,
                       _default_group_right, _frame, _group_store, _proof, _received, _stderr_size)

if harness.without_ofi():
    pytest.skip(harness.without_ofi(), allow_module_level=True)

BACKEND = "torus+ofi"
PROVIDERS = ["tcp", "shm"]
# The stream's tags (ofi_transport_impl.h): the kind of message in the top bits, the sender below.
STREAM_TAG, CONTROL_TAG, HELLO_TAG = 1 << 60, 2 << 60, 3 << 60
CHUNK_BYTES = 32 * 1024
HELLO_MAGIC = 0x6F666921
# The adversary is rank 1 (its tags carry it), the victim rank 0.
ADVERSARY, VICTIM = 1, 0
# The tags of what the victim receives from rank 1 over the fabric: its stream's chunks, credits.
TAKEN = (STREAM_TAG | ADVERSARY, CONTROL_TAG | ADVERSARY)


def _fabric_hello(secret, rank, size, to, name, nonce=None, proof=None, purpose=b"torus fabric hello", carried=None):
    """A fabric hello as OfiTransport sends it (HelloMessage): magic, rank, size, the length of
    the endpoint name, the name in 240 bytes, a nonce and the proof over them."""
    nonce = nonce or os.urandom(16)
    if proof is None:
        proof = _proof(secret, purpose, rank, to, nonce, name if carried is None else carried)
    return struct.pack("<IiiI240s16s32s", HELLO_MAGIC, rank, size, len(name), name, nonce, proof)


def _eager(data):
    """An eager frame delivering `data` (float32) to the victim's receive."""
    payload = data.numpy().tobytes()
    return _frame(EAGER, nbytes=len(payload), payload=payload)


RIGHT_DATA = torch.arange(RECV_FLOATS, dtype=torch.float32)
# Under shm's inject size (4 KiB) with its frame header.
SMALL_DATA = torch.arange(256, dtype=torch.float32)

# Each stream attack: the (tag, payload) messages the adversary sends as rank 1, how its
# lifeline ends (None: left open; "close": closed without a farewell; else the farewell's
# (kind, stream bytes, read bytes)), and what the victim's error says (None: the receive must
# complete with RIGHT_DATA).
STREAM_ATTACKS = {
    "speaks_the_protocol": ([(STREAM_TAG | ADVERSARY, _eager(RIGHT_DATA))], None, None),
    "credit_too_large": ([(CONTROL_TAG | ADVERSARY, struct.pack("<Q", 1 << 40))], None,
                         ["a credit of 1099511627776 slots, where 0 were outstanding"]),
    "credit_of_wrong_size": ([(CONTROL_TAG | ADVERSARY, b"\x01\x00\x00\x00")], None, ["a credit message of 4 bytes"]),
    "chunk_longer_than_a_slot": ([(STREAM_TAG | ADVERSARY, _frame(77) + bytes(CHUNK_BYTES))], None,
                                 ["an operation with rank 1 failed: Truncation error"]),
    "data_longer_than_receive": (
        [(STREAM_TAG | ADVERSARY, _frame(READY_TO_SEND, nbytes=4096, sequence=1) +
          _frame(DATA, nbytes=8192, sequence=1, payload=b"\xff" * 8192))],
        None, ["data frame of 8192 bytes", "for a receive of 4096 bytes"]),
    "eager_past_limit": ([(STREAM_TAG | ADVERSARY, _frame(EAGER, nbytes=1 << 40))], None,
                         ["eager frame of 1099511627776 bytes"]),
    "unknown_kind": ([(STREAM_TAG | ADVERSARY, _frame(77))], None, ["unknown kind 77"]),
    "huge_eager_credit": ([(STREAM_TAG | ADVERSARY, _frame(CREDIT, sequence=1 << 62))], None,
                          ["a credit of 4611686018427387904 eager bytes"]),
    # A frame split over two chunks reads as one; tags that name no receive of the victim's (no
    # kind of message, a rank not in the group, the victim itself) are never taken.
    "split_frame_and_unknown_tags": (
        [(5 << 60 | ADVERSARY, _eager(-RIGHT_DATA)), (STREAM_TAG | 7, _eager(-RIGHT_DATA)),
         (STREAM_TAG | VICTIM, _eager(-RIGHT_DATA)), (CONTROL_TAG | 7, struct.pack("<Q", 1 << 40)),
         (STREAM_TAG | ADVERSARY, _eager(RIGHT_DATA)[:40]), (STREAM_TAG | ADVERSARY, _eager(RIGHT_DATA)[40:])],
        None, None),
    "truncated_frame_then_death": ([(STREAM_TAG | ADVERSARY, _frame(EAGER, nbytes=4096)[:30])], "close", ["rank 1"]),
    "truncated_frame_then_goodbye": ([(STREAM_TAG | ADVERSARY, _frame(EAGER, nbytes=4096)[:30])], (GOODBYE_KIND, 30, 0),
                                     ["rank 1 left the group"]),
    "goodbye_then_frame": ([(STREAM_TAG | ADVERSARY, _frame(GOODBYE) + _eager(-RIGHT_DATA))], None,
                           ["a frame of kind 1 after its goodbye"]),
    "farewell_says_more_read_than_sent": ([], (GOODBYE_KIND, 0, 1 << 40),
                                          ["read count says it read 1099511627776 bytes"]),
    # A ready-to-send whose payload the victim is to read from the adversary's memory, lent with a
    # key the adversary never registered: the provider refuses the read.
    "read_with_a_forged_key": (
        [(STREAM_TAG | ADVERSARY, _frame(READY_TO_SEND, nbytes=4096, sequence=1, address=0x10000, key=0x5EC12E7))],
        None, ["reading 4096 bytes from rank 1 failed"]),
}


# Where a provider, not the transport, cannot survive an attack: the test says so and skips.
PROVIDER_LIMITS = {
    ("shm", "chunk_longer_than_a_slot"):
        "libfabric's shm provider (1.17) copies a message longer than its receive with process_vm_readv "
        "forever, inside fi_cq_read (measured: 2.6 million calls in 3 s): the victim never gets control back",
}


# Where a provider answers an attack by never answering: the group's timeout (short here) bounds
# it, and the victim's error says so, naming the adversary.
BOUNDED_BY_TIMEOUT = {
    # shm reads lent memory itself, and never completes a read of memory nobody lent.
    ("shm", "read_with_a_forged_key"): ["timed out reading 4096 bytes from rank 1"],
}
GROUP_TIMEOUT = datetime.timedelta(seconds=8)


def _native():
    import torus_testing

    return torus_testing.module()


def _provider_missing(provider):
    """Why the adversary cannot open an endpoint of `provider` here, or None."""
    try:
        _native().OfiAdversary(provider).close()
    except RuntimeError as error:
        return first_line(error)
    return None


@pytest.fixture(scope="module", params=PROVIDERS)
def provider(request):
    """Each provider, with the test module built before any rank starts (ranks load it)."""
    missing = _provider_missing(request.param)
    if missing:
        pytest.skip(f"libfabric's {request.param} provider cannot be opened here: {missing}")
    return request.param


def _env(provider):
    return {"TORUS_OFI_PROVIDER": provider}


class _FakeLifeline:
    """The adversary's lifeline listener: accepts the victim's dial, checks nothing and answers it
    with the group's proof (the adversary is rank 1: it knows the secret), and holds it."""

    def __init__(self, secret, adversary, victim):
        self.secret, self.adversary, self.victim = secret, adversary, victim
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(30)
        self.line = None
        self.dialed = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def where(self):
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _accept(self):
        try:
            line, _ = self.listener.accept()
        except OSError:
            return
        line.settimeout(30)
        hello = _answer(line, 60)
        if hello is not None:
            line.sendall(_proof(self.secret, b"torus lifeline accept", self.adversary, self.victim, hello[12:28]))
        self.line = line
        self.dialed.set()

    def end(self, how):
        """Ends the line: None leaves it open, "close" closes it, else says that farewell and then
        closes it, as a rank that leaves does."""
        if how is None:
            return
        if how != "close":
            kind, stream_bytes, read_bytes = how
            self.line.sendall(struct.pack("<IIQQII", FAREWELL_MAGIC, kind, stream_bytes, read_bytes, 0, 0))
        self.line.close()

    def close(self):
        self.listener.close()
        self.thread.join(timeout=30)
        if self.line is not None:
            self.line.close()


def _case_stream_attack(ctx, provider, attack):
    """Rank 1 publishes the adversary's endpoint and lifeline as its own before rank 0 needs it;
    rank 0's receive from rank 1 makes its stream to the adversary, which sends the attack's
    messages once rank 0 dialed the lifeline (by then its receives for the stream are posted)."""
    adversary, victim = ADVERSARY, VICTIM
    messages, lifeline_end, expected = STREAM_ATTACKS[attack]
    expected = BOUNDED_BY_TIMEOUT.get((provider, attack), expected)
    # Nothing connects before the first request.
    group = ctx.new_group([0, 1], timeout=GROUP_TIMEOUT if (provider, attack) in BOUNDED_BY_TIMEOUT else None)
    store = _group_store(group)
    problems = []
    if ctx.rank == adversary:
        secret = bytes(store.get("auth/secret"))
        victim_name = bytes.fromhex(bytes(store.get(f"ofi/{victim}")).decode().split(" ")[1])
        endpoint = _native().OfiAdversary(provider)
        lifeline = _FakeLifeline(secret, adversary, victim)
        store.set(f"ofi/{adversary}", f"{lifeline.where} {endpoint.name.hex()}")
        dist.barrier()  # rank 0 looks rank 1 up from now on
        # Rank 0 dials the lifeline once its stream to the adversary, with its receives, is made.
        if not lifeline.dialed.wait(30):
            problems.append("the victim never dialed the adversary's lifeline")
        else:
            for tag, payload in messages:
                # A message no receive takes may never complete (shm waits for the receive).
                endpoint.send(victim_name, tag, payload, timeout=10 if tag in TAKEN else 0.5)
            lifeline.end(lifeline_end)
        # The endpoint answers what the victim asks of it (an RMA read) until the victim has looked.
        looked = threading.Event()
        answering = threading.Thread(target=lambda: [endpoint.progress(0.05) for _ in iter(looked.is_set, True)])
        answering.start()
        dist.barrier()  # the victim has looked
        looked.set()
        answering.join()
        dist.destroy_process_group(group)
        dist.barrier()
        endpoint.close()
        lifeline.close()
    else:
        dist.barrier()
        # Exactly the receive's size: under AddressSanitizer a byte past it is reported.
        buffer = torch.full((RECV_FLOATS,), SENTINEL)
        work = dist.irecv(buffer, src=adversary, tag=TAG, group=group)
        if expected is None:
            try:
                work.wait(timeout=datetime.timedelta(seconds=PROMPT_SECONDS))
                if not buffer.equal(RIGHT_DATA):
                    problems.append(f"the receive got {buffer[:4].tolist()}..., not the adversary's message")
            except Exception as error:  # noqa: BLE001 - any error is a problem here
                problems.append(f"the receive failed: {first_line(error)}")
        else:
            problems += _attack_fails(group, work, buffer, expected, adversary)
        dist.barrier()
        dist.destroy_process_group(group)
        dist.barrier()
    return problems + _default_group_right(ctx)


@pytest.mark.parametrize("attack", list(STREAM_ATTACKS))
def test_a_lying_stream_fails_only_its_sender(provider, attack):
    if (provider, attack) in PROVIDER_LIMITS:
        pytest.skip(PROVIDER_LIMITS[provider, attack])
    harness.check(BACKEND, 2, _case_stream_attack, provider, attack, env=_env(provider), timeout=90)


def _attacked_group_right(ctx, group, after):
    """Problems unless the attacked group's allreduce still gives the right sum."""
    t = torch.full((1000,), float(ctx.rank + 1))
    want = sum(range(1, dist.get_world_size(group) + 1))
    try:
        dist.all_reduce(t, group=group)
    except Exception as error:  # noqa: BLE001 - any error is a problem here
        return [f"the attacked group's allreduce failed after {after}: {first_line(error)}"]
    return [] if t.eq(want).all() else [f"the attacked group's allreduce gave {t[:4].tolist()} after {after}"]


def _forged_fabric_hellos(secret, claimed, victim, size, name):
    """(a valid hello as rank `claimed` of `size`, [(what, hello)] that must all be turned away):
    forged, unproven, replayed or malformed fabric hellos from the endpoint named `name`."""

    def hello(**kw):
        return _fabric_hello(secret, kw.pop("rank", claimed), kw.pop("size", size), victim, kw.pop("name", name), **kw)

    nonce = os.urandom(16)
    return hello(nonce=nonce), [
        ("the same hello again (replayed)", hello(nonce=nonce)),
        ("a hello as the victim itself", hello(rank=victim)),
        (f"a hello as rank {size + 3} of {size}", hello(rank=size + 3)),
        ("a hello as rank -1", hello(rank=-1)),
        ("a hello of another group's size", hello(size=size + 1)),
        ("a hello without a proof", hello(proof=bytes(32))),
        ("a hello proven with another secret", _fabric_hello(os.urandom(32), claimed, size, victim, name)),
        ("a hello proven for another receiver", _fabric_hello(secret, claimed, size, size + 1, name)),
        ("a hello proven for a lifeline", hello(purpose=b"torus lifeline hello", carried=b"")),
        ("a hello whose endpoint is not the one proven", hello(carried=b"another endpoint")),
        ("a hello whose name is longer than its field", hello()[:12] + struct.pack("<I", 241) + hello()[16:]),
        ("a hello cut short", hello()[:100]),
    ]


def _fabric_hellos_turned_away(since):
    """How many fabric hellos this process's stderr (the harness's log) reports turned away since
    `since`."""
    with open("/proc/self/fd/2", "rb") as f:
        f.seek(since)
        return sum("warning: turned away a fabric hello from" in line
                   for line in f.read().decode(errors="replace").splitlines())


def _in_a_process_of_its_own(ctx, fn, *args):
    """fn(*args)'s result, from a fresh Python process (which runs no rank)."""
    code = ("import pickle, sys; fn, args = pickle.load(open(sys.argv[1], 'rb')); "
            "pickle.dump(fn(*args), open(sys.argv[2], 'wb'))")
    call, result = os.path.join(ctx.scratch, "call.pickle"), os.path.join(ctx.scratch, "result.pickle")
    with open(call, "wb") as f:
        pickle.dump((fn, args), f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    done = subprocess.run([sys.executable, "-c", code, call, result], env=env, capture_output=True, timeout=60)
    if done.returncode != 0:
        return [f"the forger's process failed: {done.stderr.decode(errors='replace')[-2000:]}"]
    with open(result, "rb") as f:
        return pickle.load(f)


def _send_fabric_hellos(provider, secret, sender, victim, size, victim_name):
    """In a process of its own: sends a valid fabric hello as `sender`, then every forged one, from
    an endpoint of its own to the victim's. Returns problems."""
    endpoint = _native().OfiAdversary(provider)
    valid, hellos = _forged_fabric_hellos(secret, sender, victim, size, endpoint.name)
    # The valid one, as a rank whose stream is made, is taken and changes nothing.
    problems = [f"{what}: its send never completed" for what, hello in [("the valid hello", valid), *hellos]
                if not endpoint.send(victim_name, HELLO_TAG | sender, hello)]
    endpoint.close()
    return problems


def _case_fabric_hellos(ctx, provider):
    """Forged fabric hellos, from an endpoint of a process that runs no rank (over shm, libfabric
    1.17 was seen to crash or stall a rank's process that held a second endpoint), are turned away
    and reported, and change nothing: a send from rank 1 still arrives, and the group still
    computes right. The victim's receive, posted first, makes its stream to rank 1, so the valid
    hello as rank 1 finds it made; rank 1 sends the victim nothing before the hellos, so its shm
    segment is still named (once every peer has reached it, its name goes, and no new endpoint can
    reach it at all)."""
    victim, sender, size = VICTIM, ADVERSARY, 2
    group = ctx.new_group(list(range(size)))
    store = _group_store(group)
    problems = []
    forged = len(_forged_fabric_hellos(bytes(32), sender, victim, size, b"")[1])
    if ctx.rank == sender:
        secret = bytes(store.get("auth/secret"))
        victim_name = bytes.fromhex(bytes(store.get(f"ofi/{victim}")).decode().split(" ")[1])
        dist.barrier()
        problems += _in_a_process_of_its_own(ctx, _send_fabric_hellos, provider, secret, sender, victim, size,
                                             victim_name)
        dist.send(RIGHT_DATA, victim, tag=TAG, group=group)
    else:
        logged = _stderr_size()
        buffer = torch.full((2 * RECV_FLOATS,), SENTINEL)
        work = dist.irecv(buffer[:RECV_FLOATS], src=sender, tag=TAG, group=group)
        dist.barrier()
        problems += _received(work, buffer, RIGHT_DATA, "forged fabric hellos")
    # Both ranks keep the group making progress until the victim has read every hello.
    deadline = time.monotonic() + PROMPT_SECONDS
    while True:
        seen = torch.tensor([float(_fabric_hellos_turned_away(logged) if ctx.rank == victim else forged)])
        dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=group)
        if seen.item() >= forged or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if ctx.rank == victim and seen.item() != forged:
        problems.append(f"{int(seen.item())} fabric hellos reported turned away, expected {forged}")
    problems += _attacked_group_right(ctx, group, "forged fabric hellos")
    dist.destroy_process_group(group)
    return problems + _default_group_right(ctx)


def test_forged_fabric_hellos_never_become_a_rank(provider):
    harness.check(BACKEND, 2, _case_fabric_hellos, provider, env=_env(provider), timeout=90)


def _case_outsider(ctx, provider):
    """An endpoint that never proved a hello sends, tagged as rank 1, a chunk holding an eager
    frame for the victim's receive, and a credit word too large: neither is taken. The receive gets
    what the real rank 1 sends, and the group still computes right. (The streams are made by the
    victim's receive, before the real rank 1 sends anything: see _case_fabric_hellos. The receive
    is small enough that shm would send them at once, not waiting for a receive.)"""
    adversary, victim = ADVERSARY, VICTIM
    group = ctx.new_group([0, 1])
    problems = []
    if ctx.rank == adversary:
        victim_name = bytes.fromhex(bytes(_group_store(group).get(f"ofi/{victim}")).decode().split(" ")[1])
        endpoint = _native().OfiAdversary(provider)
        dist.barrier()
        # Never taken: shm may never complete them.
        endpoint.send(victim_name, STREAM_TAG | adversary, _eager(-SMALL_DATA), timeout=0.5)
        endpoint.send(victim_name, CONTROL_TAG | adversary, struct.pack("<Q", 1 << 40), timeout=0.5)
        dist.send(SMALL_DATA, victim, tag=TAG, group=group)
    else:
        buffer = torch.full((2 * SMALL_DATA.numel(),), SENTINEL)
        work = dist.irecv(buffer[:SMALL_DATA.numel()], src=adversary, tag=TAG, group=group)
        dist.barrier()
        problems += _received(work, buffer, SMALL_DATA, "an outsider's messages tagged as rank 1's")
    problems += _attacked_group_right(ctx, group, "an outsider's messages")
    dist.destroy_process_group(group)
    dist.barrier()
    if ctx.rank == adversary:
        endpoint.close()
    return problems + _default_group_right(ctx)


def test_an_outsiders_chunks_are_never_taken_for_a_ranks(provider):
    if provider == "shm":
        # An outsider over shm is a process of the same host that may open the victim's segment,
        # which the operating system's permissions already let in (docs/security.md).
        pytest.skip("over shm the segments' permissions are the guard: its receives take messages from any "
                    "endpoint of the host (libfabric's shm provider does not match a directed receive with "
                    "what a peer sent before it was inserted, so the transport does not direct them there)")
    harness.check(BACKEND, 2, _case_outsider, provider, env=_env(provider), timeout=90)
