"""What the collective tests (test_collectives.py, test_collectives_p2p.py) share: a call whose
failure is noted as a problem, a non-contiguous copy of a tensor, and a check that the group still
works after a call it refused."""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference import first_line


def attempt(fn, label, problems):
    """Call fn(); record an exception as a problem; return False if it raised."""
    try:
        fn()
        return True
    except Exception as e:
        problems.append(f"{label}: raised {first_line(e)}")
        return False


def strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding a copy of t (every other element of a bigger buffer)."""
    buf = torch.zeros((t.numel() * 2 + 1,), dtype=t.dtype)
    v = buf[1::2].view(t.shape) if t.dim() <= 1 else None
    if v is None:  # multi-dim: a column slice
        buf = torch.zeros(t.shape[:-1] + (t.shape[-1] * 2,), dtype=t.dtype)
        v = buf[..., ::2]
    v.copy_(t)
    return v


def group_still_works():
    t = torch.ones(3)
    try:
        dist.all_reduce(t)
    except Exception as e:
        return [f"group unusable after a rejected call: {first_line(e)}"]
    n = dist.get_world_size()
    return [] if t.eq(n).all() else [f"group broken after a rejected call: {t.tolist()}"]
