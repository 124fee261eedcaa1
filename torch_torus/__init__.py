"""torch-torus: a collective communication backend for torch.distributed.

``import torch_torus`` registers the backend "torus"::

    dist.init_process_group(backend="torus")
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from . import _C
from .config import SETTINGS, ConfigError, Options, local_address, resolve
from .selection import describe, resolve_tables
from .topology import choose_grid, choose_transport, exchange_host_ids, host_identity, publish_failure
from .tuning import read as read_tuning
from .tuning import tuned_allreduce

__all__ = ["Options", "ConfigError", "SETTINGS", "BACKEND_NAME", "algorithm_for"]

BACKEND_NAME = "torus"
_LOG_LEVELS = {"warn": 0, "info": 1, "debug": 2}
# Collectives that have one algorithm each, so no setting chooses among several.
_SINGLE_ALGORITHM = {"alltoall": "pairwise", "reduce": "binomial", "gather": "direct", "scatter": "direct",
                     "barrier": "dissemination"}


def group_config(values: dict, size: int, hosts: list[str], address: str = "127.0.0.1",
                 tuning: list | None = None):
    """The C++ configuration of a group of `size` ranks on `hosts` (one host identity per rank)
    from resolved settings: (config, grid, transport, tables, tuned table or None). Raises
    ConfigError naming the setting when the settings do not fit the group. `tuning`: the
    entries of the tuning file, read already (tuning.read)."""
    grid = choose_grid(size, hosts, values["torus_dims"])
    transport = choose_transport(values["transport"], hosts)
    tuned = tuned_allreduce(values["tuning_file"], hosts, grid, entries=tuning)
    tables = resolve_tables(values, size, grid, transport, tuned_allreduce=tuned)
    config = _C.TorusConfig()
    config.transport = transport
    config.address = address
    config.chunk_bytes = values["chunk_bytes"]
    config.algorithms = {c: [_C.AlgorithmRule(r.algorithm, r.lo, r.hi) for r in rules] for c, rules in tables.items()}
    config.torus_rows = [list(row) for row in grid.rows] if grid else []
    config.torus_inner = values["torus_inner"]
    config.log_level = _LOG_LEVELS[values["log_level"]]
    return config, grid, transport, tables, tuned


def _create_backend(dist_options, pg_options) -> _C.ProcessGroupTorus:
    rank, size, store = dist_options.group_rank, dist_options.group_size, dist_options.store
    # Everything that can fail on this rank alone fails before the ranks meet in the store, and
    # says so there: the others then fail at once naming this rank, rather than wait for it
    # until their timeout.
    try:
        values = resolve(pg_options)
        identity = values["host_id"] or host_identity()
        address = local_address(values["socket_ifname"])
        tuning = read_tuning(values["tuning_file"]) if values["tuning_file"] else None
    except Exception as error:
        publish_failure(store, rank, str(error) if isinstance(error, ConfigError) else f"{type(error).__name__}: {error}")
        raise
    hosts = exchange_host_ids(store, rank, size, identity)
    config, grid, transport, tables, tuned = group_config(values, size, hosts, address, tuning)
    name = dist_options.group_id or ""
    if config.log_level >= 1 and rank == 0:
        layout = f"torus grid {grid}" if grid else f"no torus grid for {size} ranks: torus runs as ring"
        print(f"[torus rank 0] group '{name}': {size} ranks on {len(set(hosts))} host(s) over {transport}, {layout}; "
              f"auto allreduce from {values['tuning_file'] if tuned else 'the cost model'}; "
              f"algorithms {describe(tables)}", file=sys.stderr, flush=True)
    return _C.ProcessGroupTorus(store, rank, size, dist_options.timeout, config, name)


def algorithm_for(collective: str, nbytes: int, group: dist.ProcessGroup | None = None) -> str:
    """The algorithm `group` (default: the world) runs `collective` with for `nbytes` bytes.

    collective: "allreduce", "allgather", "reduce_scatter" or "broadcast" (chosen by size), or
    "alltoall", "reduce", "gather", "scatter" or "barrier" (one algorithm each); nbytes counts
    the call's largest buffer, as nccl-tests do (allgather: the output, reduce_scatter: the input).
    """
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("torch_torus.algorithm_for: no process group; call init_process_group first")
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ProcessGroupTorus):
        raise ValueError(f"torch_torus.algorithm_for: the group's CPU backend is {type(backend).__name__}, "
                         "not torus")
    return _SINGLE_ALGORITHM.get(collective) or backend.algorithm_for(collective, nbytes)


# CUDA is listed so that CUDA tensors reach the backend and get its clear "not supported yet"
# error rather than torch's "no backend for device".
dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])
