"""The hybrid update: synchronous inside a host, asynchronous across hosts.

Gradients are allreduced every step among the ranks of one host only (DDP over the host's
group, through shared memory). Every `period` steps each host's parameters and floating buffers
(BatchNorm statistics) are averaged across hosts by an allreduce started in the background and
applied `delay` steps later, at the same step on every rank, as
x <- x + (average(snapshot) - snapshot): the local progress made meanwhile is kept.

    groups = torch_torus.host_groups()
    model = DistributedDataParallel(model, process_group=groups.host)
    averager = torch_torus.HybridAverager(model, groups, period=8, delay=4, warmup_steps=100)
    for images, labels in data:
        optimizer.zero_grad()
        loss_function(model(images), labels).backward()   # allreduced inside the host only
        optimizer.step()
        averager.step()
    averager.drain()   # before evaluating or saving a checkpoint: every rank holds the same model

Hosts are what the backend itself found (its host identity: host name, boot id, namespaces, or
TORUS_HOST_ID), never a guess from rank numbers, which srun and mpiexec do not number by host.
Each cross-host group holds the ranks with the same local rank on every host; each averages one
shard of the model, so every rank of a host drives an equal share of the traffic between hosts,
and the host's ranks then gather the shards over shared memory.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["HostGroups", "HybridAverager", "HybridUpdateError", "host_groups", "plan_host_groups"]

# Integer views of the same width, for a bit-exact checksum of floating tensors.
_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _averaged(t: torch.Tensor) -> bool:
    """Whether a buffer is averaged: floating or complex ones are; integer and bool ones (counters
    such as BatchNorm's num_batches_tracked) stay as they are."""
    return t.is_floating_point() or t.is_complex()


def _real(t: torch.Tensor) -> torch.Tensor:
    """The tensor as real numbers: a complex one as (real, imaginary) pairs, which average
    apart, sharing its storage."""
    return torch.view_as_real(t) if t.is_complex() else t


class HybridUpdateError(RuntimeError):
    """The hybrid update cannot go on: a cross-host average failed or timed out, or the ranks of
    a host no longer hold the same model."""


def plan_host_groups(hosts: Sequence) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of each host and of each cross-host group, given each rank's host (any
    hashable label, one per rank): hosts in the order of their lowest rank, ranks ascending;
    cross-host group k holds the k-th rank of every host. A ValueError naming the hosts when
    they do not all hold the same number of ranks."""
    by_host: dict = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    host_ranks = list(by_host.values())
    if len({len(ranks) for ranks in host_ranks}) > 1:
        layout = "; ".join(f"host {host!r}: ranks {ranks}" for host, ranks in by_host.items())
        raise ValueError(f"the hybrid update needs the same number of ranks on every host (each rank "
                         f"averages its share of the model with the ranks of the same local rank on "
                         f"the other hosts), but the hosts hold {layout}")
    cross_ranks = [list(ranks) for ranks in zip(*host_ranks)]
    return host_ranks, cross_ranks


@dataclass(frozen=True)
class HostGroups:
    """This rank's groups for the hybrid update (host_groups() makes them)."""

    host: dist.ProcessGroup  # the ranks of this rank's host: gradients, over shared memory
    cross: dist.ProcessGroup  # the ranks with this rank's local rank on every host
    host_ranks: list[int]  # global ranks of `host`, ascending
    cross_ranks: list[int]  # global ranks of `cross`, one per host in host order
    num_hosts: int

    @property
    def local_rank(self) -> int:
        """This rank's index on its host (and its shard of the model)."""
        return self.host_ranks.index(dist.get_rank())


def host_groups(timeout: datetime.timedelta | None = None) -> HostGroups:
    """One group per host and one cross-host group per local rank, over the default group, from
    the hosts the torus backend found for it. Every rank of the default group must call this, in
    the same order relative to its other new_group calls. `timeout`: the groups' timeout (default:
    the default group's), which bounds a cross-host average that never completes."""
    from . import _torus_backend

    world = _torus_backend(None, "host_groups")
    host_ranks, cross_ranks = plan_host_groups(list(world.config.hosts))
    rank = dist.get_rank()
    # new_group is collective over the default group: every rank creates every group, in one order.
    mine: dict[str, tuple[dist.ProcessGroup, list[int]]] = {}
    for kind, lists in (("host", host_ranks), ("cross", cross_ranks)):
        for ranks in lists:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[kind] = (group, ranks)
    return HostGroups(host=mine["host"][0], cross=mine["cross"][0], host_ranks=mine["host"][1],
                      cross_ranks=mine["cross"][1], num_hosts=len(host_ranks))


@dataclass
class _Average:
    """A cross-host average in flight."""

    started_at: int  # the step whose parameters it averages
    apply_at: int
    snapshot: torch.Tensor  # this host's parameters and buffers at started_at, flat and padded
    shard: torch.Tensor  # this rank's shard of the snapshot / hosts, summed across hosts in place
    work: dist.Work


class HybridAverager:
    """Averages a model across hosts every `period` steps, in the background.

    module: the model, or its DistributedDataParallel wrapper, which must then be built over
    groups.host (gradients would cross hosts otherwise, and with its default
    broadcast_buffers=True DDP would send rank 0's buffers over the network at every forward).
    The parameters and floating and complex buffers are averaged (complex ones as real and
    imaginary parts; one precision: float64 with complex128, float32 with complex64, ...); integer
    and bool buffers, such as BatchNorm's num_batches_tracked, stay as they are, equal on every
    rank that ran the same steps.

    period: steps between the starts of two cross-host averages (H, at least 1).
    delay: steps from the start of an average to its application (τ, 0 to period); 0 waits for
    the average at once (the synchronous periodic average). An average started at step s is
    applied when step() is called for step s + delay, on every rank alike.
    warmup_steps: the first steps are fully synchronous: a blocking average after every step.

    The constructor sends rank 0's parameters and buffers to every rank (DDP over the host group
    only makes a host's ranks agree). Call step() after every optimizer step and drain() before
    evaluation or a checkpoint. Before each average the ranks of a host compare a checksum of
    their parameters and buffers, and raise HybridUpdateError naming those that differ.
    """

    def __init__(self, module: nn.Module, groups: HostGroups, period: int, delay: int = 0,
                 warmup_steps: int = 0):
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"HybridAverager: period must be an integer of at least 1, got {period!r}")
        if not isinstance(delay, int) or not 0 <= delay <= period:
            raise ValueError(f"HybridAverager: delay must be an integer from 0 to period={period}, got {delay!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"HybridAverager: warmup_steps must be an integer of at least 0, got {warmup_steps!r}")
        if isinstance(module, DistributedDataParallel):
            ddp_ranks = dist.get_process_group_ranks(module.process_group)
            if ddp_ranks != groups.host_ranks:
                raise ValueError(
                    f"HybridAverager: the DistributedDataParallel module reduces gradients over ranks "
                    f"{ddp_ranks}, not over this host's ranks {groups.host_ranks}; build it with "
                    f"process_group=groups.host, so that gradients (and, with broadcast_buffers, the "
                    f"buffers at every forward) stay inside the host")
            module = module.module
        self.groups = groups
        self.period, self.delay, self.warmup_steps = period, delay, warmup_steps
        parameters = list(module.parameters())
        buffers = [b for b in module.buffers() if _averaged(b)]
        self._tensors = parameters + buffers
        unaveraged = sorted({str(t.dtype) for t in self._tensors if not _averaged(t)})
        if unaveraged:
            raise ValueError(f"HybridAverager: the module has parameters of dtype {unaveraged}, which cannot be "
                             f"averaged; only floating and complex parameters can")
        precisions = {_real(t).dtype for t in self._tensors}
        if len(precisions) != 1:
            kinds = sorted({str(t.dtype) for t in self._tensors})
            raise ValueError(f"HybridAverager: the module's parameters and floating or complex buffers must "
                             f"share one precision (the dtypes {kinds} average as {sorted(map(str, precisions))}); "
                             f"convert the module to one, e.g. module.double()")
        self._buffers_from = len(parameters)
        self._parameter_count = sum(_real(p).numel() for p in parameters)
        self._count = self._parameter_count + sum(_real(b).numel() for b in buffers)
        ranks_per_host = len(groups.host_ranks)
        self._shard_count = -(-self._count // ranks_per_host)  # padded so that shards are equal
        self._steps = 0
        self._pending: _Average | None = None
        flat = self._flatten()
        dist.broadcast(flat, src=0)
        self._write(flat)

    def step(self) -> None:
        """Count one training step (after the optimizer's): apply the average due now, and start
        the one due now."""
        self._steps += 1
        if self._steps <= self.warmup_steps:
            self._average_now()
            return
        if self._pending is not None and self._pending.apply_at == self._steps:
            self._apply()
        if (self._steps - self.warmup_steps) % self.period == 0:
            self._start(self._steps + self.delay)
            if self.delay == 0:
                self._apply()

    def finish(self) -> None:
        """Wait for the average in flight, if any, and apply it now rather than at its step;
        every rank must call it at the same step."""
        if self._pending is not None:
            self._apply()

    def drain(self) -> None:
        """finish(), then average once more, blocking: afterwards every rank holds the same
        parameters and buffers (for evaluation or a checkpoint). Training may go on after it;
        the schedule of averages is unchanged."""
        self.finish()
        self._average_now()

    def _average_now(self) -> None:
        self._start(self._steps)
        self._apply()

    def _flatten(self) -> torch.Tensor:
        padding = self._shard_count * len(self.groups.host_ranks) - self._count
        pieces = [_real(t.detach()).reshape(-1) for t in self._tensors]
        pieces.append(pieces[0].new_zeros(padding))
        return torch.cat(pieces)

    @torch.no_grad()
    def _write(self, flat: torch.Tensor, subtract: torch.Tensor | None = None,
               buffers_only: bool = False) -> None:
        """tensors <- flat, or tensors += flat - subtract."""
        offset = 0
        for index, tensor in enumerate(self._tensors):
            t = _real(tensor)
            if index >= self._buffers_from or not buffers_only:
                piece = flat[offset:offset + t.numel()].view_as(t)
                if subtract is None:
                    t.copy_(piece)
                else:
                    t.add_(piece - subtract[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def _snapshot(self) -> torch.Tensor:
        """This host's parameters and buffers, flat, identical on its ranks (checked)."""
        flat = self._flatten()
        # A host's ranks hold the same parameters (the same gradients every step) but each its
        # own BatchNorm statistics, from its own batch: take the host's first rank's, as DDP's
        # next forward would.
        buffers = flat[self._parameter_count:self._count]
        if buffers.numel():
            dist.broadcast(buffers, group_src=0, group=self.groups.host)
            self._write(flat, buffers_only=True)
        self._check_host(flat)
        return flat

    def _check_host(self, flat: torch.Tensor) -> None:
        bits = flat.view(_SAME_WIDTH_INTEGER[flat.element_size()])
        # Two sums, one of them over every other element, so that two swapped values show too.
        mine = torch.stack([bits.sum(dtype=torch.int64), bits[::2].sum(dtype=torch.int64)])
        host_ranks = self.groups.host_ranks
        everyone = mine.new_empty(len(host_ranks), 2)
        dist.all_gather_single(everyone, mine, group=self.groups.host)
        differing = [rank for rank, sums in zip(host_ranks, everyone) if not torch.equal(sums, everyone[0])]
        if differing:
            raise HybridUpdateError(
                f"hybrid update: at step {self._steps} rank(s) {differing} hold other parameters or "
                f"buffers than rank {host_ranks[0]} of the same host (ranks {host_ranks}); a host's "
                f"ranks must stay bit-identical: build DDP over groups.host and call step() at every "
                f"step on every rank")

    def _start(self, apply_at: int) -> None:
        snapshot = self._snapshot()
        begin = self.groups.local_rank * self._shard_count
        shard = snapshot[begin:begin + self._shard_count].clone()
        if self.groups.num_hosts > 1:
            shard.div_(self.groups.num_hosts)
        work = dist.all_reduce(shard, group=self.groups.cross, async_op=True)
        self._pending = _Average(self._steps, apply_at, snapshot, shard, work)

    def _apply(self) -> None:
        average, self._pending = self._pending, None
        try:
            average.work.wait()
        except Exception as error:
            raise HybridUpdateError(
                f"hybrid update: rank {dist.get_rank()}'s cross-host average (ranks "
                f"{self.groups.cross_ranks}) of the model at step {average.started_at}, waited "
                f"for at step {self._steps}, failed: {error}") from error
        averaged = torch.empty_like(average.snapshot)
        dist.all_gather_single(averaged, average.shard, group=self.groups.host)
        if average.started_at == self._steps:
            # Nothing was learned meanwhile: take the average as it is, the same bits on every rank.
            self._write(averaged)
        else:
            self._write(averaged, subtract=average.snapshot)
