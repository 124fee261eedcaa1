"""A torchft process group whose collectives run on torus.

torchft (PyTorch's fault-tolerance library) re-creates its process group at every quorum change,
in the same processes, over a fresh prefix of its store; it ships wrappers for gloo and NCCL only.
``ProcessGroupTorus`` is the torus one::

    from torch_torus.torchft import ProcessGroupTorus
    manager = torchft.Manager(pg=ProcessGroupTorus(timeout=timedelta(seconds=30)), ...)

torchft 0.2.0's Manager calls ``configure(store_addr, replica_id, rank, world_size, ...)``; its
later releases call ``set_rank_info`` then ``reconfigure(opts)`` instead. Both end in torchft's
``ProcessGroupWrapper._create_pg(store, rank, world_size)``, which is all this class overrides of
the creation, so it follows either API. Tested with torchft 0.2.0 and torchft-nightly 2026.10.26.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as error:
    raise ImportError("torch_torus.torchft needs torchft: pip install torchft") from error

from . import _create_backend
from .config import Options

_BackendType = dist.ProcessGroup.BackendType


class ProcessGroupTorus(ProcessGroupWrapper):
    """A reconfigurable torus process group for torchft's Manager.

    Args:
        timeout: the timeout of creating the group (torchft's store and the ranks' meeting) and
            the default timeout of its collectives.
        options: torch_torus.Options for every group it creates (else the TORUS_* environment).
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60), options: Options | None = None) -> None:
        super().__init__(timeout)
        self._options = options
        self._errored: Exception | None = None

    def getBackendName(self) -> str:
        return "torchft-torus"

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        # torchft's wrapper has aborted the previous group; a group that fails to form leaves the
        # error this sets in its place.
        self._errored = None
        backend_options = dist.distributed_c10d._DistributedBackendOptions()
        backend_options.store = store
        backend_options.group_rank = rank
        backend_options.group_size = world_size
        backend_options.timeout = self._timeout
        backend_options.group_id = self._torus_group_name()
        backend_options.global_ranks_in_group = list(self._global_ranks or [])
        backend = _create_backend(backend_options, self._options)
        # As torch's init_process_group registers a plugin backend: one backend for both devices.
        group = dist.ProcessGroup(store, rank, world_size)
        group._set_default_backend(_BackendType.CUSTOM)
        for device in ("cpu", "cuda"):
            group._register_backend(torch.device(device), _BackendType.CUSTOM, backend)
        return group

    def _torus_group_name(self) -> str:
        """The torus group's name (its logs, its flight recorder's directory): the quorum and the
        rank in the replica group, as torchft names its gloo and NCCL groups."""
        # torchft 0.2.0 numbers quorums (_quorum_id); its later releases name communicators (_uuid).
        quorum = getattr(self, "_quorum_id", None)
        if quorum is None:
            quorum = getattr(self, "_uuid", None)
        return f"torchft_{quorum}_rank_{getattr(self, '_group_rank', None) or 0}"

    def abort(self, errored: bool = True) -> None:
        """Aborts the group: collectives in flight fail at once, and this returns within a bounded
        time even when a peer or the store froze. torchft aborts at every quorum change (errored
        False); an abort with nothing in flight writes no flight-recorder dump."""
        # Set before the abort, as torchft's NCCL wrapper does: a step whose collective the abort
        # cut short reads errored() and is not committed.
        self._errored = RuntimeError("torus: the torchft process group was aborted")
        super().abort(errored=errored)

    def shutdown(self) -> None:
        """Ends the group: its queued collectives finish (each within its timeout), then its worker
        thread and connections are released."""
        group = self._pg
        self._pg = None
        if group is not None:
            group.shutdown()

    def errored(self) -> Exception | None:
        """The error that requires reconfiguration, if any: the group was aborted or failed to form.
        A collective's own failure reaches torchft's Manager through its work."""
        return self._errored
