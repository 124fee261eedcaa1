"""torch-torus: a collective communication backend for torch.distributed.

Installed, it registers the backend "torus" at ``import torch`` (torch_torus_autoload.py); this
package is loaded when the first torus group is created, or by ``import torch_torus``::

    dist.init_process_group(backend="torus")
"""

from __future__ import annotations

import atexit
import datetime
import json
import secrets
import sys
import types

import torch
import torch.distributed as dist
from torch_torus_autoload import BACKEND_NAME, register_backend

from . import _C, callbacks
from ._version import __version__
from .agreement import settings_record, settings_verdict
from .config import SETTINGS, ConfigError, Options, resolve
from .cost_model import MACHINES
from .hybrid import HostGroups, HybridAverager, HybridUpdateError, host_groups
from .launch import init_from_launcher, init_from_mpi, init_from_slurm
from .network import local_address
from .selection import describe, resolve_tables
from .topology import (FAILED, Meeting, agree, choose_grid, choose_transport, describe_failures, failures_of,
                       host_identity, meeting_of, meeting_record, rendezvous_environ)
from .tuning import read as read_tuning
from .tuning import entries_of, host_memory_gbps, tuned_allreduce

__all__ = ["__version__", "Options", "ConfigError", "SETTINGS", "BACKEND_NAME", "register", "backend_of",
           "algorithm_for", "traffic", "reset_traffic",
           "init_from_mpi", "init_from_slurm", "init_from_launcher", "monitored_barrier", "shrink_group",
           "host_groups", "HostGroups", "HybridAverager", "HybridUpdateError", "dump_trace", "empty_cache",
           "shared_memory_stats"]

_LOG_LEVELS = {"warn": 0, "info": 1, "debug": 2}


def group_config(values: dict, size: int, hosts: list[str], address: str = "127.0.0.1",
                 tuning: list | None = None):
    """The C++ configuration of a group of `size` ranks on `hosts` (one host identity per rank)
    from resolved settings: (config, grid, transport, tables, tuned table or None). Raises
    ConfigError naming the setting when the settings do not fit the group. `tuning`: the
    entries of the tuning file, read already (tuning.read)."""
    grid = choose_grid(size, hosts, values["torus_dims"])
    transport = choose_transport(values["transport"], hosts)
    tuned = tuned_allreduce(values["tuning_file"], hosts, grid, transport, entries=tuning)
    # A layout the file has no table for still runs on the memory the tuner measured.
    memory = host_memory_gbps(values["tuning_file"], entries=tuning) if transport == "shm" else None
    machine = MACHINES["shm"].with_memory(memory) if memory is not None else None
    tables = resolve_tables(values, size, grid, transport, machine=machine, tuned_allreduce=tuned, hosts=hosts)
    config = _C.TorusConfig()
    config.transport = transport
    config.address = address
    config.ofi_provider = values["ofi_provider"]
    config.ofi_rma_bytes = values["ofi_rma_bytes"]
    config.chunk_bytes = values["chunk_bytes"]
    config.eager_bytes = values["eager_bytes"]
    config.eager_window = values["eager_window"]
    config.inline_bytes = values["inline_bytes"]
    config.wait = values["wait"]
    config.algorithms = {c: [_C.AlgorithmRule(r.algorithm, r.lo, r.hi) for r in rules] for c, rules in tables.items()}
    config.torus_rows = [list(row) for row in grid.rows] if grid else []
    config.torus_inner = values["torus_inner"]
    config.hosts = [sorted(set(hosts)).index(h) for h in hosts]
    config.log_level = _LOG_LEVELS[values["log_level"]]
    config.device_stall_ms = max(1, round(values["device_stall_timeout"] * 1000))
    config.host_device = values["host_device"]
    config.trace_buffer = values["trace_buffer"]
    config.shared_tensor_cache = values["shared_tensor_cache"]
    return config, grid, transport, tables, tuned


def _create_backend(dist_options, pg_options) -> _C.ProcessGroupTorus:
    rank, size, store = dist_options.group_rank, dist_options.group_size, dist_options.store
    name = dist_options.group_id or ""
    timeout = dist_options.timeout.total_seconds()
    # Everything that can fail on this rank alone fails before the ranks meet in the store, and
    # says so there: the others then fail at once naming this rank, rather than wait for it
    # until their timeout.
    try:
        values = resolve(pg_options)
        identity = values["host_id"] or host_identity()
        # The address that routes to the group's TCPStore (init_method tcp://, env://,
        # torchrun), else to MASTER_ADDR, else the host name's.
        address = local_address(values["socket_ifname"], rendezvous_environ(store))
        tuning = read_tuning(values["tuning_file"]) if values["tuning_file"] else None
        # Its address travels in this rank's record, and rank 0 publishes every rank's at once.
        listener = _C.TcpListener(address, size) if _may_use_tcp(values["transport"], size) else None
    except Exception as error:
        if size > 1:
            _tell_the_others(store, rank, size, FAILED + _failure_text(error), timeout)
        raise
    result = meet(store, rank, size, values, identity, address, tuning, timeout, name,
                  listener.address if listener else None)
    epoch = result["epoch"]
    # Every key the group reads from here on is its own, never one an earlier group of this name
    # left in the store (an earlier attempt under torchrun, a group destroyed and created again).
    store = dist.PrefixStore(f"torus/{epoch}", store)
    meeting = Meeting.of(result, size)
    hosts = meeting.hosts
    # Settings that do not fit the group fail it on every rank alike: every rank has the same.
    config, grid, transport, tables, tuned = group_config(values, size, hosts, address, tuning)
    if transport != "shm" and not values["host_id"]:
        meeting.check_addresses(rank)
    if config.log_level >= 1 and rank == 0:
        layout = f"torus grid {grid}" if grid else f"no torus grid for {size} ranks: torus runs as ring"
        model = "the cost model"
        if len(set(hosts)) > 1:
            model += (f" with host links of {values['link_bandwidth'] * 8 / 1e9:g} Gbit/s, "
                      f"{values['link_latency'] * 1e6:g} us")
        print(f"[torus rank 0] group '{name}': {size} ranks on {len(set(hosts))} host(s) over {transport}, {layout}; "
              f"auto allreduce from {values['tuning_file'] if tuned else model}; "
              f"algorithms {describe(tables)}", file=sys.stderr, flush=True)
    if transport in _OVER_TCP:
        config.tcp_listener = listener
    # Imported here: a package-level import would load trace.py before `python -m torch_torus.trace`
    # runs it as __main__ (runpy warns, and the module exists twice).
    from .trace import trace_directory

    config.trace_dir = trace_directory(values["trace_dir"], name, epoch)
    config.secret = bytes.fromhex(result["secret"])
    if rank == 0 and size > 1:
        publish_secret(store, config.secret)
    group = _C.ProcessGroupTorus(store, rank, size, dist_options.timeout, config, name)
    group.set_global_ranks(list(dist_options.global_ranks_in_group))
    group.set_settings(_settings_text(pg_options if isinstance(pg_options, Options) else None))
    return group


def _settings_text(options: Options | None) -> str:
    """`options`' settings as the C++ group keeps them for a shrink (JSON; each value as the text
    config.resolve parses)."""
    if options is None:
        return "{}"
    if not isinstance(options, Options):
        raise TypeError(f"torus: pg_options must be torch_torus.Options or None, got {type(options).__name__}")
    return json.dumps({option: value if isinstance(value, str) else str(value)
                       for option, value in options.settings.items()})


def _create_shrunk_backend(store, rank: int, size: int, timeout: datetime.timedelta, name: str,
                           global_ranks: list[int], settings: str) -> _C.ProcessGroupTorus:
    """The survivors' group of a shrink (dist.shrink_group; ProcessGroupTorus::shrinkWith calls it),
    created as any torus group is, over `store` (the old group's, under a prefix of the shrink's
    own), with `settings` (_settings_text's)."""
    creation = types.SimpleNamespace(group_rank=rank, group_size=size, store=store, group_id=name, timeout=timeout,
                                     global_ranks_in_group=global_ranks)
    return _create_backend(creation, Options(**json.loads(settings)))


# The group's secret: its length (transport/group_secret.h's kSecretBytes), and the key of the
# group's store rank 0 also keeps it under.
_SECRET_BYTES = 32
_SECRET_KEY = "auth/secret"


def publish_secret(group_store, secret: bytes) -> None:
    """Rank 0 keeps the group's secret in the group's store, for tools that speak the wire
    protocol (docs/security.md); no rank reads it to create the group."""
    group_store.set(_SECRET_KEY, secret)


# The transports whose ranks accept TCP connections from each other.
_OVER_TCP = ("tcp", "shm+tcp")


def _may_use_tcp(setting: str, size: int) -> bool:
    """Whether a group of `size` ranks with TORUS_TRANSPORT `setting` may run over TCP, whatever
    hosts its ranks turn out to live on."""
    return size > 1 and setting in (*_OVER_TCP, "auto")


def meet(store, rank: int, size: int, values: dict, identity: str, address: str, tuning, timeout: float,
         name: str, tcp_address: str | None = None) -> dict:
    """The ranks of a group meet in its store (topology.agree), each with where it lives, the
    address its TCP listener accepts on (`tcp_address`, when it opened one) and a digest of the
    settings it must share (agreement.py); the result every rank returns: the group's epoch, its
    hosts (Meeting.of), its secret. Before it answers, rank 0 publishes the TCP address of every
    rank that sent one, under the epoch (tcp/<rank>), when the group runs over TCP. Raises
    ConfigError, on every rank alike, naming the ranks that cannot create the group or each
    setting they disagree on; DistBackendError naming the ranks that did not come within
    `timeout` seconds."""
    digest, detail = settings_record(values, tuning and {"path": values["tuning_file"],
                                                         "entries": [entry.record for entry in tuning]})

    def decide(records: list[str], details, epoch: str) -> dict:
        """Rank 0's answer to every rank's record: who cannot create the group, else where the
        ranks live, whether they agree on their settings (a verdict naming every difference),
        and the group's secret."""
        failed = failures_of(records)
        if failed:
            return {"failed": failed}
        parsed = [_parse_record(r, record) for r, record in enumerate(records)]
        answer = meeting_of(parsed)
        hosts = Meeting.of(answer, size).hosts

        def tables_of(theirs: dict | None):
            entries = entries_of(theirs["entries"], theirs["path"]) if theirs else None
            return group_config(values, size, hosts, address, entries)[3]

        verdict = settings_verdict([p["settings"] for p in parsed], details, tables_of)
        if not verdict and _may_use_tcp(values["transport"], size) and \
                choose_transport(values["transport"], hosts) in _OVER_TCP:
            published = [(f"torus/{epoch}/tcp/{r}", p["tcp"]) for r, p in enumerate(parsed) if "tcp" in p]
            if published:
                store.multi_set(*map(list, zip(*published)))
        return {**answer, "verdict": verdict, "secret": secrets.token_hex(_SECRET_BYTES)}

    fields = {"tcp": tcp_address} if tcp_address else {}
    record = json.dumps({**meeting_record(identity, address, values["socket_ifname"]), **fields, "settings": digest})
    try:
        result = agree(store, rank, size, record, decide, timeout, detail)
    except TimeoutError as error:
        raise dist.DistBackendError(f"torus: cannot create group '{name}' (rank {rank} of {size}): {error}") from None
    if "failed" in result:
        raise ConfigError(describe_failures(result["failed"]))
    # Before the transport connects: a rank whose settings differ from its peers' where they must
    # agree fails the group on every rank, naming them.
    if result["verdict"]:
        raise ConfigError(result["verdict"])
    return result


_RECORD_FIELDS = (*meeting_record("", "", ""), "settings")


def _parse_record(rank: int, record: str) -> dict:
    """A rank's meeting record, read by rank 0 (records come from the network)."""
    try:
        parsed = json.loads(record)
        if not isinstance(parsed, dict) or not all(isinstance(parsed.get(field), str) for field in _RECORD_FIELDS) \
                or not isinstance(parsed.get("tcp", ""), str):
            raise ValueError
        return parsed
    except ValueError:
        raise ValueError(f"rank {rank}'s meeting record is not one a torus rank sends: {record[:80]!r}") from None


def _tell_the_others(store, rank: int, size: int, record: str, timeout: float) -> None:
    """Meet the other ranks with `record` (FAILED + this rank's error): they fail naming it."""
    try:
        agree(store, rank, size, record, None, timeout)
    except Exception:  # the store is gone, or the others are: they time out, naming this rank
        pass


def _failure_text(error: Exception) -> str:
    """What a rank that cannot create a group tells its peers."""
    return str(error) if isinstance(error, ConfigError) else f"{type(error).__name__}: {error}"


def _torus_backend(group: dist.ProcessGroup | None, caller: str) -> _C.ProcessGroupTorus:
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError(f"torch_torus.{caller}: no process group; call init_process_group first")
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ProcessGroupTorus):
        raise ValueError(f"torch_torus.{caller}: the group's CPU backend is {type(backend).__name__}, not torus")
    return backend


def backend_of(group: dist.ProcessGroup | None = None, device: str | None = None) -> str:
    """The backend `group` (default: the world) really runs on, asked of the group's own backend
    objects rather than of the name it was created with: "torus", "gloo", "nccl", ... when one
    backend serves all its device types, else torch's device-mapped notation
    ("cpu:torus,cuda:nccl"); with `device` ("cpu", "cuda"), the one that serves that device type.
    A framework that picks its own backend (DeepSpeed without init_distributed(dist_backend="torus")
    falls back to gloo) is caught by ``assert torch_torus.backend_of(device="cpu") == "torus"``."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("torch_torus.backend_of: no process group; call init_process_group first")
    if dist.distributed_c10d._rank_not_in_group(group):
        raise ValueError("torch_torus.backend_of: this rank is not a member of the group")
    served = {d.type: group._get_backend(d).name() for d in group._device_types}
    if device is not None:
        if device not in served:
            raise ValueError(f"torch_torus.backend_of: the group serves no device type {device!r} "
                             f"(it serves {sorted(served)})")
        return served[device]
    if len(set(served.values())) == 1:
        return next(iter(served.values()))
    return ",".join(f"{d}:{served[d]}" for d in sorted(served))


def traffic(group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """What this rank has sent in `group` (default: the world) since it was created or reset:
    bytes and messages to peers on its own host and on other hosts (same_host_bytes,
    same_host_messages, other_host_bytes, other_host_messages). Counts the messages of every
    collective and send; the shared-memory allreduces (one_shot, two_shot) copy between ranks of
    one host without messages and are not counted."""
    return _torus_backend(group, "traffic").traffic()


def dump_trace(group: dist.ProcessGroup | None = None, reason: str = "requested") -> str:
    """Writes this rank's flight recorder of `group` (default: the world) to its directory under
    TORUS_TRACE_DIR and returns the file's path ("" when TORUS_TRACE_BUFFER=0). Call it on every
    rank, then `python -m torch_torus.trace <directory>`."""
    return _torus_backend(group, "dump_trace").dump_trace(reason)


def reset_traffic(group: dist.ProcessGroup | None = None) -> None:
    """Sets this rank's traffic counters of `group` (default: the world) to zero."""
    _torus_backend(group, "reset_traffic").reset_traffic()


def algorithm_for(collective: str, nbytes: int, group: dist.ProcessGroup | None = None) -> str:
    """The algorithm `group` (default: the world) runs `collective` with for `nbytes` bytes.

    collective: "allreduce", "allgather", "reduce_scatter" or "broadcast" (chosen by size), or
    "alltoall", "reduce", "gather", "scatter" or "barrier" (one algorithm each); nbytes counts
    the call's largest buffer, as nccl-tests do (allgather: the output, reduce_scatter: the input).
    """
    return _torus_backend(group, "algorithm_for").algorithm_for(collective, nbytes)


def shared_memory_stats() -> dict[str, int]:
    """This process's shared tensors (CPU tensors of 64 KiB or more from a torus group's
    allocate_tensor, which live in memfd segments its peers map): live_bytes and live_segments
    (tensors in use), free_bytes and free_segments (freed, kept for reuse), limit_bytes (the most
    free_bytes may reach now: TORUS_SHARED_TENSOR_CACHE, 0 once no group is left), peak_live_bytes
    (since the cache was last emptied) and released_segments (given back to the system, ever)."""
    return _C.shared_memory_stats()


def empty_cache() -> int:
    """Gives every freed shared tensor segment this process keeps for reuse back to the system,
    as torch.cuda.empty_cache() does for CUDA memory; returns their bytes. Live tensors stay. A
    peer unmaps its view of a given-back segment at its next shared-memory collective with this
    rank, or when its group is destroyed."""
    return _C.empty_cache()


_torch_monitored_barrier = dist.monitored_barrier


def monitored_barrier(group: dist.ProcessGroup | None = None, timeout=None, wait_all_ranks: bool = False) -> None:
    """torch.distributed.monitored_barrier, for torus groups too (``import torch_torus`` puts it in
    torch.distributed's place). torch's own refuses every backend but gloo by name before it asks
    the backend; torus implements it as gloo does: rank 0 waits up to `timeout` for every other
    rank and raises naming the first that did not come (all of them with wait_all_ranks), and
    the others raise when rank 0 fails. Groups of other backends go to torch's function."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None or dist.distributed_c10d._rank_not_in_group(pg) or not _is_torus(pg):
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    if timeout is None:
        timeout = dist.constants.default_pg_timeout
    elif isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"monitored_barrier timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def _is_torus(group: dist.ProcessGroup) -> bool:
    return _torus_serves(group, torch.device("cpu"))


dist.monitored_barrier = monitored_barrier
dist.distributed_c10d.monitored_barrier = monitored_barrier

_torch_shrink_group = dist.shrink_group


def shrink_group(ranks_to_exclude: list[int], group: dist.ProcessGroup | None = None,
                 shrink_flags: int = dist.distributed_c10d.SHRINK_DEFAULT, pg_options=None) -> dist.ProcessGroup:
    """torch.distributed.shrink_group, for torus groups too (``import torch_torus`` puts it in
    torch.distributed's place). torch registers the shrunk group's backend under the CPU as gloo's,
    which DDP's logger then reads as a gloo group (and crashes on); a shrunk torus group is
    registered as every torus group is, a custom backend, for each device the old group ran on
    torus. Groups of other backends are torch's alone."""
    old = group if group is not None else dist.group.WORLD
    devices = [device for device in (torch.device("cpu"), torch.device("cuda"))
               if old is not None and _torus_serves(old, device)]
    shrunk = _torch_shrink_group(ranks_to_exclude, group, shrink_flags, pg_options)
    if devices:
        backend = shrunk._get_backend(devices[0])
        for device in devices:
            shrunk._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, backend)
        shrunk._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    return shrunk


def _torus_serves(group: dist.ProcessGroup, device: torch.device) -> bool:
    try:
        return isinstance(group._get_backend(device), _C.ProcessGroupTorus)
    except RuntimeError:  # no backend for the device
        return False


dist.shrink_group = shrink_group
dist.distributed_c10d.shrink_group = shrink_group

# A script that ends without destroy_process_group ends its groups here, before Python finalizes:
# their workers finish the collectives in flight and run their futures' callbacks while they can
# still take the GIL, and are joined, so that none drops a tensor or runs Python code once the
# interpreter finalizes (which aborts the process). Handlers registered after this import, a
# user's own among them, run before it.
atexit.register(_C.shut_down_groups)



def register() -> None:
    """Registers the backend "torus" with torch.distributed. ``import torch_torus`` does it, and so
    does ``import torch`` where torch-torus is installed; call it where neither has happened in the
    process that creates the group, or as a framework's setup hook by name
    (``worker_process_setup_hook="torch_torus.register"`` in Ray)."""
    register_backend(_create_backend)


callbacks.install()
register()
