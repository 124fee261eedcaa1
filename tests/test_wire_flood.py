"""Floods on the wire: a rank of the group (the adversary) dials the victim's listening socket
thousands of times with bytes that are no hello, while both run the group's collectives. The
victim closes every such connection without writing a byte to it, its collectives stay right,
and its warnings about them are bounded (csrc/transport/turned_away_log.h): a few one by one,
then summary lines that count the rest, written by a thread that a stalled stderr stalls alone.
A rank whose group failed tells only a proven peer why. The helpers are test_wire.py's."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

import torch
import torch.distributed as dist

import harness
from test_wire import (BACKEND, SHORT_TIMEOUT, _attacked_group, _default_group_right, _group_store, _hello, _knock,
                       _read_published, _stderr_size)


# A flood of connections that send bytes that are no hello, while the group's collectives run.
FLOOD_CONNECTIONS, FLOOD_DIALERS = 2000, 4
# csrc/transport/turned_away_log.h: the first of a burst reported one by one, then a summary line
# at most every 5 s.
ONE_BY_ONE, SUMMARY_EVERY_S = 16, 5.0
GAVE_UP = 0x71756974


def _until_closed(sock):
    """Every byte the victim sends on `sock` before it closes it (b"": it wrote none)."""
    got = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return got
        got += chunk


def _flood(where, connections, answered, errors):
    """Dials `where` `connections` times, one at a time, with 60 bytes that are no hello (a hello's
    size), reading each connection until the victim closes it; what any was answered goes into
    `answered`."""
    try:
        for _ in range(connections):
            with socket.create_connection(where, timeout=30) as sock:
                sock.sendall(os.urandom(60))
                got = _until_closed(sock)
                if got:
                    answered.append(got)
    except OSError as error:
        errors.append(repr(error))


def _turned_away_lines(offset):
    with open("/proc/self/fd/2", "rb") as f:
        f.seek(offset)
        return [line for line in f.read().decode(errors="replace").splitlines() if "warning: turned away" in line]


def _allreduces_during_flood(ctx, group, run, adversary):
    """The adversary floods the victim's listening socket while both run allreduces on the group
    until it is done; (problems, allreduces run, seconds)."""
    import threading

    problems, answered, errors = [], [], []
    dist.barrier()
    started = time.monotonic()
    dialers = []
    if ctx.rank == adversary:
        listen = tuple(_read_published(ctx, f"{run}-listen")[0])
        dialers = [threading.Thread(target=_flood, args=(listen, FLOOD_CONNECTIONS // FLOOD_DIALERS, answered, errors))
                   for _ in range(FLOOD_DIALERS)]
        for dialer in dialers:
            dialer.start()
    # Collectives all along the flood: the last element says the adversary's dialers are done.
    rounds = 0
    while True:
        t = torch.full((1001,), float(ctx.rank + 1))
        t[-1] = float(ctx.rank == adversary and not any(d.is_alive() for d in dialers))
        dist.all_reduce(t, group=group)
        rounds += 1
        if not t[:-1].eq(3.0).all():
            problems.append(f"allreduce {rounds} during the flood gave {t[:4].tolist()}")
            break
        if t[-1] > 0:
            break
        if time.monotonic() - started > 120:
            problems.append("the flood did not end within 120 s")
            break
    elapsed = time.monotonic() - started
    for dialer in dialers:
        dialer.join(timeout=30)
    problems += [f"a dialer failed: {e}" for e in errors[:3]]
    problems += [f"{len(answered)} connections that sent no hello were answered, e.g. {answered[0][:40]!r}"
                 ] if answered else []
    return problems, rounds, elapsed


def _case_flood(ctx):
    import re

    adversary, victim = 1, 0
    group, made, run = _attacked_group(ctx, victim, timeout=SHORT_TIMEOUT)
    logged = _stderr_size()
    problems, rounds, elapsed = _allreduces_during_flood(ctx, group, run, adversary)
    if ctx.rank == victim:
        # The one summary still due comes within SUMMARY_EVERY_S of the flood's end.
        deadline = time.monotonic() + SUMMARY_EVERY_S + 10
        summary = re.compile(r"turned away (\d+) more TCP connections in the last [0-9.]+ s.*; (\d+) turned away so far")
        while True:
            lines = _turned_away_lines(logged)
            one_by_one = [line for line in lines if "warning: turned away a TCP connection from 127.0.0.1:" in line]
            summaries = [m for m in map(summary.search, lines) if m]
            reported = len(one_by_one) + sum(int(m.group(1)) for m in summaries)
            if reported >= FLOOD_CONNECTIONS or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if len(one_by_one) != ONE_BY_ONE:
            problems.append(f"{len(one_by_one)} connections reported one by one, expected {ONE_BY_ONE}")
        if reported != FLOOD_CONNECTIONS or not summaries or int(summaries[-1].group(2)) != FLOOD_CONNECTIONS:
            problems.append(f"{reported} connections reported turned away, expected {FLOOD_CONNECTIONS}: "
                            f"{[m.group(0) for m in summaries]}")
        bound = ONE_BY_ONE + int(elapsed / SUMMARY_EVERY_S) + 2
        if len(lines) > bound:
            problems.append(f"{len(lines)} lines about turned-away connections in {elapsed:.1f} s, more than {bound}")
        print(f"flood: {rounds} allreduces, {len(lines)} lines in {elapsed:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group(group)
    return problems + _default_group_right(ctx)


def test_a_flood_of_bad_hellos_is_closed_unanswered_and_logged_at_a_bounded_rate():
    harness.check(BACKEND, 2, _case_flood, timeout=240)


def _case_flood_with_stderr_stalled(ctx):
    """The victim's stderr is a pipe that is full and that nobody reads: the flood's warnings wait
    for it, the group's collectives do not."""
    import fcntl
    import threading

    adversary, victim = 1, 0
    group, made, run = _attacked_group(ctx, victim, timeout=SHORT_TIMEOUT)
    if ctx.rank == victim:
        sys.stderr.flush()
        drain, full = os.pipe()
        fcntl.fcntl(full, fcntl.F_SETFL, os.O_NONBLOCK)
        try:
            while True:
                os.write(full, b"x" * 65536)
        except BlockingIOError:
            pass
        fcntl.fcntl(full, fcntl.F_SETFL, 0)
        log = os.dup(2)
        os.dup2(full, 2)
    try:
        problems, rounds, elapsed = _allreduces_during_flood(ctx, group, run, adversary)
    finally:
        if ctx.rank == victim:
            os.dup2(log, 2)
            os.close(log)
            os.close(full)

            def read_all():  # the writer's stalled line ends once the pipe drains
                while os.read(drain, 65536):
                    pass
                os.close(drain)

            threading.Thread(target=read_all, daemon=True).start()
    dist.barrier()
    dist.destroy_process_group(group)
    return problems + _default_group_right(ctx)


def test_a_stalled_stderr_stalls_no_collective():
    harness.check(BACKEND, 2, _case_flood_with_stderr_stalled, timeout=240)


def _case_unproven_after_abort(ctx):
    """A rank whose group failed tells a peer that connects why only once its hello proves it is
    one: connections accepted before the abort with part of a hello or none, and one after it
    with bytes that are no hello, hear nothing before they are closed."""
    adversary, victim = 1, 0
    group, made, run = _attacked_group(ctx, victim, timeout=SHORT_TIMEOUT)
    problems, waiting = [], []
    if ctx.rank == adversary:
        listen = tuple(_read_published(ctx, f"{run}-listen")[0])
        secret = bytes(_group_store(group).get("auth/secret"))
        waiting = [socket.create_connection(listen, timeout=30) for _ in range(2)]
        waiting[0].sendall(_hello(secret, adversary, 2, victim)[:30])
        time.sleep(0.5)  # accepted, and the partial hello read
        dist.barrier()
        dist.barrier()  # the victim aborted its group
        with socket.create_connection(listen, timeout=30) as sock:
            sock.sendall(os.urandom(60))
            got = _until_closed(sock)
            if got:
                problems.append(f"bytes that are no hello, after the abort, were answered {got[:40]!r}")
        got = _knock(listen, _hello(secret, adversary, 2, victim), 8)
        if got is None or struct.unpack("<I", got[:4])[0] != GAVE_UP:
            problems.append(f"a proven hello after the abort was answered {got!r}, not that the victim gave up")
        dist.barrier()
    else:
        dist.barrier()
        group._get_backend(torch.device("cpu")).abort()
        dist.barrier()
        dist.barrier()
    dist.destroy_process_group(group)
    dist.barrier()  # the victim's transport is gone: so are the connections it held
    for what, sock in zip(("part of a hello", "no hello"), waiting):
        with sock:
            got = _until_closed(sock)
            if got:
                problems.append(f"a connection with {what} before the abort was answered {got[:40]!r}")
    return problems + _default_group_right(ctx)


def test_connections_unproven_when_the_group_aborts_hear_nothing():
    harness.check(BACKEND, 2, _case_unproven_after_abort, timeout=90)
