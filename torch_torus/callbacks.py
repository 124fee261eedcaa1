"""Futures' callbacks, as the backend needs to see them: when each was attached.

A collective issued by a future's callback takes its place in the group's order at the point
where the callback was attached (``then()`` or ``add_done_callback()``): the same point on every
rank, whether the callback runs on the group's worker when the collective completes or at once,
inside ``then()``, because it had completed already. Its signature says a callback issued it.
Only this wrapper sees the attaching: torch's Future gives no other hook.
"""

from __future__ import annotations

import functools

import torch

from . import _C


def _attaching(method):
    @functools.wraps(method)
    def attach(self, callback):
        attached = _C._AttachedCallback()

        @functools.wraps(callback)
        def in_scope(future):
            with attached:
                return callback(future)

        return method(self, in_scope)

    attach.tells_torus = True
    return attach


def install() -> None:
    """Wraps torch's Future.then() and add_done_callback(), once per process."""
    for name in ("then", "add_done_callback"):
        method = getattr(torch._C.Future, name)
        if not getattr(method, "tells_torus", False):
            setattr(torch._C.Future, name, _attaching(method))
