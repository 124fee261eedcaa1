"""Registers the backend "torus" at ``import torch``, so that every place that takes a backend name
(``init_process_group("torus")``, Ray Train's ``TorchConfig(backend="torus")``, a launcher's
``--backend torus``) takes it without an ``import torch_torus``.

torch calls ``autoload`` through the "torch.backends" entry point (pyproject.toml) at the end of
``import torch``; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns that off. This module lives outside the
torch_torus package on purpose: loading ``torch_torus.anything`` runs torch_torus/__init__.py, which
loads the C++ extension, and a process that never creates a torus group must not pay for that at
``import torch``. It registers the name with a creator that imports torch_torus when the first torus
group is created; that import registers torch_torus's own creator in its place.
"""

import sys
import warnings

BACKEND_NAME = "torus"
# CUDA is listed so that plain backend="torus" serves CUDA tensors too (a build without the CUDA
# path answers them with an error naming the tensor, rather than torch's "no backend for device").
DEVICES = ("cpu", "cuda")


def register_backend(creator) -> None:
    """Registers "torus" with torch.distributed, created by `creator` (torch's extended API: it gets
    c10d's DistributedBackendOptions and the group's pg_options)."""
    import torch.distributed as dist

    dist.Backend.register_backend(BACKEND_NAME, creator, extended_api=True, devices=list(DEVICES))


def _create_on_first_use(dist_options, pg_options):
    import torch_torus

    return torch_torus._create_backend(dist_options, pg_options)


def autoload() -> None:
    """The "torch.backends" entry point. Never raises: torch turns an exception here into a failed
    ``import torch``; a registration that fails is a warning, and ``import torch_torus`` still
    registers the backend."""
    try:
        import torch.distributed as dist

        # A torch built without distributed has no backends to register with; torch_torus already
        # imported has registered its own creator.
        if dist.is_available() and "torch_torus" not in sys.modules:
            register_backend(_create_on_first_use)
    except Exception as error:
        _warn(f"torch-torus: the backend 'torus' was not registered at `import torch` ({type(error).__name__}: "
              f"{error}); `import torch_torus` registers it (TORCH_DEVICE_BACKEND_AUTOLOAD=0 skips this step)")


def _warn(message: str) -> None:
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    except Exception:  # warnings are errors here (python -W error): still not a failed import torch
        print(f"warning: {message}", file=sys.stderr)
