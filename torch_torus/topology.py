"""Where the ranks of a group live, and the torus grid that follows from it.

Ranks share a host when they share a host identity: the host name, the kernel's boot id and
the network and pid namespaces together, because containers and namespaces on one machine can
share a host name while they cannot share loopback or reach each other's processes' memory
(TORUS_HOST_ID overrides it). Ranks that share a host use the shared-memory transport.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Mapping

from .config import ConfigError


def host_identity() -> str:
    """This process's host identity: host name, boot id, network and pid namespaces."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for namespace in ("net", "pid"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{namespace}"))
        except OSError:
            pass
    return "|".join(parts)


# A rank that cannot create the group publishes this, then its error, in place of its record.
FAILED = "\x00failed\x00"


@dataclass(frozen=True)
class Meeting:
    """What the ranks of a group learn of each other when they meet in its store."""

    hosts: list[str]  # each rank's host, as "host<i>" (i counts hosts by their lowest rank)
    # The first rank that would listen on a loopback address while the group spans hosts, its
    # address, and its TORUS_SOCKET_IFNAME; None when there is none.
    loopback: tuple[int, str, str] | None = None

    @classmethod
    def of(cls, answer: dict, size: int) -> "Meeting":
        """The meeting `answer` (meeting_of's) tells a group of `size` ranks of."""
        numbers = answer["hosts"] if "hosts" in answer else [r // answer["ranks_per_host"] for r in range(size)]
        loopback = answer["loopback"]
        return cls([f"host{h}" for h in numbers], tuple(loopback) if loopback else None)

    def check_addresses(self, rank: int) -> None:
        """Fail, on every rank alike, when a rank would publish a loopback address to peers on
        other hosts (they would try it until the timeout): e.g. a host name that resolves to
        127.0.1.1 and no MASTER_ADDR to route to, or TORUS_SOCKET_IFNAME=lo."""
        if self.loopback is None:
            return
        peer, address, ifname = self.loopback
        if peer != rank:
            how = f"rank {peer}'s own error says where it comes from"
        elif ifname:
            how = f"from TORUS_SOCKET_IFNAME={ifname!r}"
        else:
            how = "the address routing to the rendezvous host, else the host name's"
        raise ConfigError(
            f"torus: rank {peer} would listen on {address}, a loopback address ({how}), "
            f"but the group spans {len(set(self.hosts))} hosts, whose ranks cannot reach it; set "
            "TORUS_SOCKET_IFNAME to the interface that connects the hosts (e.g. eth0), or "
            "rendezvous at an address the hosts share (MASTER_ADDR, init_method tcp://)")


def _is_loopback(address: str) -> bool:
    if not address.startswith("127.") and ":" not in address:  # rank 0 looks at every rank's: be quick
        return False
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def failures_of(records: list[str]) -> dict[str, str]:
    """The errors of the ranks whose record (rank order) says they cannot create the group."""
    return {str(r): v[len(FAILED):] for r, v in enumerate(records) if v.startswith(FAILED)}


def describe_failures(failed: dict[str, str]) -> str:
    """'rank 2 cannot create the group: <its error>; ...'"""
    return "; ".join(f"rank {r} cannot create the group: {why}" for r, why in failed.items())


def meeting_record(identity: str, address: str, ifname: str) -> dict:
    """What a rank tells rank 0 of where it lives (meeting_of reads it)."""
    return {"id": identity, "address": address, "ifname": ifname}


def meeting_of(records: list[dict]) -> dict:
    """Rank 0's answer to every rank's meeting_record (rank order): host numbers and the loopback
    verdict. The host numbers travel as ranks_per_host when every host holds that many ranks in
    a row (the usual layout, and one rank per host), so that no rank reads a list of them all."""
    numbers: dict[str, int] = {}
    hosts = [numbers.setdefault(record["id"], len(numbers)) for record in records]
    loopback = None
    if len(numbers) > 1:
        loopback = next(([r, record["address"], record["ifname"]] for r, record in enumerate(records)
                         if _is_loopback(record["address"])), None)
    per_host = len(hosts) // len(numbers)
    if len(hosts) % len(numbers) == 0 and all(h == r // per_host for r, h in enumerate(hosts)):
        return {"ranks_per_host": per_host, "loopback": loopback}
    return {"hosts": hosts, "loopback": loopback}


# The keys of the ranks' meeting, the only ones a group reads that an earlier group of the same
# name (an earlier attempt under torchrun, whose agent keeps its store across restarts; a group
# destroyed and created again on the same store) may have left. The counter counts the rank 0s
# that ever arrived (each numbers a generation, under which its meeting's keys live), in units of
# RANK0_ARRIVAL, and the generations resolved (a result set: the places read, or superseded), in
# ones: a rank that reads it learns at once whether the latest generation still takes places.
_GENERATIONS_KEY = "torus/epoch/generations"
RANK0_ARRIVAL = 1 << 32
# A generation's result when a later rank 0 arrived before its own rank 0 closed it.
SUPERSEDED = "superseded"
# A generation's result when rank 0 asks ranks for their details (the JSON list of them follows);
# the result proper is then the generation's verdict.
_DETAILS_WANTED = "details wanted "


def _generation_key(generation: int, name: str) -> str:
    return f"torus/epoch/{generation}/{name}"


def latest_epoch(store) -> str | None:
    """The epoch the latest generation of the group on `store` agreed on (its keys live under
    torus/<epoch>/), or None while it has none: for tools and tests that read a live group's keys."""
    generation = store.add(_GENERATIONS_KEY, 0) // RANK0_ARRIVAL
    for name in ("result", "verdict"):
        key = _generation_key(generation, name)
        if generation == 0 or not store.check([key]):
            return None
        result = bytes(store.get(key)).decode()
        if not result or result == SUPERSEDED:
            return None
        if not result.startswith(_DETAILS_WANTED):
            return json.loads(result)["epoch"]
    return None


def agree(store, rank: int, size: int, record: str, decide, timeout: float, detail: str = "") -> dict | None:
    """The one round in which the ranks of a group meet in its store: each publishes `record`
    (and `detail`, which rank 0 reads only when it asks), rank 0 reads every record with one
    read, and `decide(records, details, epoch)` (records in rank order; details(ranks) reads those
    ranks' details, once) makes the result every rank returns, with "epoch" added: a name no
    earlier group on this store has used, under which the group keeps its keys
    (torus/<epoch>/), and under which decide may publish keys before any rank sees the result. A
    record FAILED + error says the rank cannot create the group: rank 0's fails it at once
    ({"failed": {"0": error}}), another rank's returns None, and rank 0 gets it among the
    records. At most four store operations per rank in the usual round, each immediate or a
    blocking wait (no polling); rank 0 alone reads the N records, in one request.

    Rank 0 arrives by adding RANK0_ARRIVAL to a counter, whose value numbers its generation g;
    every other rank reads the counter and claims its rank's place in generation g with one
    compare_set of a key of its own (g/rank/<rank>), its record under a random claim name. A
    claim counts only when it finds the place empty: so every member is a contemporary of g's
    rank 0 (a rank that came before g's rank 0 claimed an earlier generation's place, or none),
    and never one of an earlier attempt whose rank 0 is gone. Rank 0 waits for the size - 1
    places, reads them and sets g's result, which resolves g (it adds 1 to the counter). A rank
    that finds no generation, or the latest one resolved (it came before its rank 0), or its place
    taken (it came after g closed), or its generation's rank 0 dead (a later rank 0 sets that
    result to SUPERSEDED first, which resolves it; compare_set, so it is one or the other,
    once), waits for the next rank 0 (g/next, which that rank 0 sets as it arrives) and claims its
    place in that generation. Raises TimeoutError naming the ranks that did not join within
    `timeout` seconds.

    When rank 0 asks for details (the ranks' settings differ), the result first names the ranks
    whose details it wants (_DETAILS_WANTED); they set them (g/detail/<rank>) and every rank
    waits for the verdict (g/verdict), which is then the result. Only a round that fails takes
    this second step."""
    if size == 1:
        epoch = secrets.token_hex(8)
        return {**decide([record], lambda ranks: [detail], epoch), "epoch": epoch}
    deadline = time.monotonic() + timeout
    if rank != 0:
        try:
            return _join(store, rank, record, detail, deadline)
        except TimeoutError as error:
            raise TimeoutError(f"rank 0 did not confirm rank {rank}'s joining within {timeout:g} s{error}") from None
    generation = store.add(_GENERATIONS_KEY, RANK0_ARRIVAL) // RANK0_ARRIVAL
    store.set(_generation_key(generation - 1, "next"), "")
    if generation > 1:
        previous = bytes(store.compare_set(_generation_key(generation - 1, "result"), "", SUPERSEDED)).decode()
        if previous == SUPERSEDED:  # this rank 0 resolved it (no other supersedes it)
            store.add(_GENERATIONS_KEY, 1)
        elif previous.startswith(_DETAILS_WANTED):
            store.compare_set(_generation_key(generation - 1, "verdict"), "", SUPERSEDED)
    answer = {"epoch": f"{generation}-{secrets.token_hex(8)}"}
    result_key, verdict_key = _generation_key(generation, "result"), _generation_key(generation, "verdict")
    if record.startswith(FAILED):  # the others fail as they join
        result = {"failed": {"0": record[len(FAILED):]}, **answer}
        _publish(store, result_key, result, resolves=False)  # ranks yet to come read it too
        return result
    places = [_generation_key(generation, f"rank/{r}") for r in range(1, size)]
    _wait_for_ranks(store, range(1, size), places, deadline, f"did not join within {timeout:g} s")
    records = [record] + [bytes(value).decode("utf-8", "replace").partition("\n")[2]
                          for value in store.multi_get(places)]
    asked: list[list[int]] = []

    def details(ranks: list[int]) -> list[str]:
        theirs = [r for r in ranks if r != 0]
        texts = {}
        if theirs:
            if asked:
                raise RuntimeError("topology.agree: details() may be called once")
            asked.append(theirs)
            _publish(store, result_key, _DETAILS_WANTED + json.dumps(theirs))
            keys = [_generation_key(generation, f"detail/{r}") for r in theirs]
            _wait_for_ranks(store, theirs, keys, deadline, f"did not send their settings within {timeout:g} s")
            texts = dict(zip(theirs, (bytes(v).decode("utf-8", "replace") for v in store.multi_get(keys))))
        return [detail if r == 0 else texts[r] for r in ranks]

    try:
        result = {**decide(records, details, answer["epoch"]), **answer}
    except Exception as error:  # a record it cannot read: the others fail at once too, naming it
        failure = {"failed": {"0": f"{type(error).__name__}: {error}"}, **answer}
        try:
            _publish(store, verdict_key if asked else result_key, failure)
        except RuntimeError:  # superseded: its members wait for the later rank 0
            pass
        raise
    _publish(store, verdict_key if asked else result_key, result)
    return result


def _wait_for_ranks(store, ranks, keys: list[str], deadline: float, failure: str) -> None:
    """Waits for each of `ranks` to set its key of `keys`; at `deadline` raises TimeoutError naming
    the ranks whose keys are missing, followed by `failure`. Only then is each key checked."""
    try:
        wait_for_keys(store, keys, deadline)
    except TimeoutError:
        missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
        raise TimeoutError(f"ranks {missing} {failure}") from None


def _publish(store, key: str, result: dict | str, resolves: bool = True) -> None:
    """Sets a generation's result (or verdict) unless a later rank 0 has superseded it first, in
    which case this rank 0 is not its group's any more: its members joined the later one. A
    result set after rank 0 read the places resolves the generation, and the counter says so.
    (One never counted, as a failed rank 0's, leaves ranks of later generations to find out by
    claiming, one request more for a rank that comes before its rank 0: never too many counted.)"""
    text = result if isinstance(result, str) else json.dumps(result)
    published = bytes(store.compare_set(key, "", text)).decode() == text
    if published and resolves and key.endswith("/result"):
        store.add(_GENERATIONS_KEY, 1)
    if not published:
        raise RuntimeError("torus: a later rank 0 arrived at this group's meeting before this one closed it: "
                           "two processes ran as rank 0 of the group, or this one was too slow and was replaced")


def _join(store, rank: int, record: str, detail: str, deadline: float) -> dict | None:
    """agree on a rank other than 0: the result of the generation it joined. Its TimeoutError
    says only what more is known of why (often nothing)."""
    claim = f"{secrets.token_hex(8)}\n{record}"
    counted = store.add(_GENERATIONS_KEY, 0)
    generation, taken = counted // RANK0_ARRIVAL, False
    unresolved = generation > counted % RANK0_ARRIVAL
    try:
        while True:
            if unresolved:
                place = _generation_key(generation, f"rank/{rank}")
                taken = bytes(store.compare_set(place, "", claim)).decode("utf-8", "replace") != claim
                if not taken:
                    result = wait_for_key(store, _generation_key(generation, "result"), deadline, read=True)
                    if result.startswith(_DETAILS_WANTED):
                        if rank in json.loads(result[len(_DETAILS_WANTED):]):
                            store.set(_generation_key(generation, f"detail/{rank}"), detail)
                        result = wait_for_key(store, _generation_key(generation, "verdict"), deadline, read=True)
                    if result != SUPERSEDED:
                        return None if record.startswith(FAILED) else json.loads(result)
            # No rank 0 had arrived, the latest generation was resolved, another process holds
            # this rank's place in it (it closed before this rank came), or its rank 0 died:
            # this rank's rank 0 is a later one.
            wait_for_key(store, _generation_key(generation, "next"), deadline)
            generation, unresolved = generation + 1, True
    except TimeoutError:
        raise TimeoutError(f" (another process holds rank {rank}'s place in the group's latest meeting: two "
                           f"processes run as rank {rank}, or rank 0 has not come)" if taken else "") from None


def wait_for_key(store, key: str, deadline: float, read: bool = False) -> str | None:
    """Blocks until `key` is set (and returns its value when `read`), or raises TimeoutError at
    `deadline` (time.monotonic())."""
    wait_for_keys(store, [key], deadline)
    return read_key(store, key) if read else None


# compare_set(key, x, x) changes nothing whatever the key holds and returns its value: a read of
# one round trip, where TCPStore's get first waits for the key (two). Never on a key that may be
# absent: TCPStore then returns x and wakes everyone waiting for the key, which is not there.
_READ_ONLY = "\0"


def read_key(store, key: str) -> str:
    """The value of `key`, known to be set (a wait for it returned), in one store request."""
    return bytes(store.compare_set(key, _READ_ONLY, _READ_ONLY)).decode()


def wait_for_keys(store, keys: list[str], deadline: float) -> None:
    """Blocks until every one of `keys` is set, or raises TimeoutError at `deadline`."""
    import torch.distributed as dist

    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        store.wait(keys, datetime.timedelta(seconds=left))
    except (TimeoutError, dist.DistStoreError, RuntimeError) as error:
        if isinstance(error, TimeoutError) or "timeout" in str(error).lower():
            raise TimeoutError(f"{', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} not set in time") from None
        raise


def rendezvous_environ(store, environ: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """`environ` (default os.environ) with MASTER_ADDR and MASTER_PORT set to the host and port
    of the TCPStore under `store` (through PrefixStores), when it is one: the address every rank
    reached already, also under init_method="tcp://..." where no MASTER_ADDR is set."""
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore) and store.host:
        return {**environ, "MASTER_ADDR": store.host, "MASTER_PORT": str(store.port)}
    return environ


# What a group runs over: shm+tcp (shm+ofi) is shared memory inside each host and TCP (OFI)
# between hosts.
GROUP_TRANSPORTS = ("tcp", "shm", "shm+tcp", "ofi", "shm+ofi")


def choose_transport(setting: str, hosts: list[str]) -> str:
    """One of GROUP_TRANSPORTS for a group whose ranks live on `hosts`, given TORUS_TRANSPORT."""
    one_host = len(set(hosts)) == 1
    if setting == "shm" and not one_host:
        raise ConfigError(
            f"TORUS_TRANSPORT=shm needs every rank on one host, but this group spans {len(set(hosts))} "
            "hosts (by host name, boot id and network namespace, or TORUS_HOST_ID); allowed here: tcp, ofi, "
            "shm+ofi, auto")
    if setting == "auto":
        if one_host:
            return "shm"
        return "shm+tcp" if len(set(hosts)) < len(hosts) else "tcp"
    return setting


@dataclass(frozen=True)
class Grid:
    """Ranks in rows of equal length: the torus reduce-scatters along rows and allreduces
    along columns (column j holds the j-th rank of every row)."""

    rows: tuple[tuple[int, ...], ...]
    reason: str

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), len(self.rows[0])

    def __str__(self) -> str:
        r, c = self.shape
        return f"{r}x{c} ({self.reason})"


def _row_major(rows: int, cols: int, reason: str) -> Grid:
    return Grid(tuple(tuple(range(i * cols, (i + 1) * cols)) for i in range(rows)), reason)


def choose_grid(size: int, hosts: list[str], dims: tuple[int, int] | None) -> Grid | None:
    """The torus grid for a group, or None when it has none (1 rank, or a prime size)."""
    if dims is not None:
        rows, cols = dims
        if rows * cols != size:
            raise ConfigError(
                f"TORUS_TORUS_DIMS={rows}x{cols} does not fit this group: {rows} x {cols} = "
                f"{rows * cols}, but the group has {size} ranks; allowed: <rows>x<columns> "
                f"with rows x columns = {size}, or empty for automatic")
        return _row_major(rows, cols, "TORUS_TORUS_DIMS")
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    per_host = {len(ranks) for ranks in by_host.values()}
    if len(by_host) > 1 and len(per_host) == 1 and per_host.pop() > 1:
        return Grid(tuple(tuple(ranks) for ranks in by_host.values()), "one row per host")
    rows = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    if rows == 1:
        return None
    return _row_major(rows, size // rows, "most square factorization")
