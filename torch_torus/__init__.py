"""torch-torus: a collective communication backend for torch.distributed.

``import torch_torus`` registers the backend "torus"::

    dist.init_process_group(backend="torus")
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C
from .config import SETTINGS, ConfigError, Options, local_address, resolve

__all__ = ["Options", "ConfigError", "SETTINGS", "BACKEND_NAME"]

BACKEND_NAME = "torus"
_LOG_LEVELS = {"warn": 0, "info": 1, "debug": 2}


def _create_backend(dist_options, pg_options) -> _C.ProcessGroupTorus:
    values = resolve(pg_options)
    config = _C.TorusConfig()
    config.address = local_address(values["socket_ifname"])
    config.chunk_bytes = values["chunk_bytes"]
    config.allreduce = values["allreduce"]
    config.log_level = _LOG_LEVELS[values["log_level"]]
    return _C.ProcessGroupTorus(
        dist_options.store,
        dist_options.group_rank,
        dist_options.group_size,
        dist_options.timeout,
        config,
        dist_options.group_id or "",
    )


# CUDA is listed so that CUDA tensors reach the backend and get its clear "not supported yet"
# error rather than torch's "no backend for device".
dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])
