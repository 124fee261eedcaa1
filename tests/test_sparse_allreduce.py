"""all_reduce of sparse COO tensors (SUM), as gloo computes it.

The reference is gloo's computation in one process: each rank's tensor coalesced, rank 0's
indices and values as a sparse tensor, each other rank's added in rank order, coalesced. The
result must equal it bit for bit (and so gloo's: the same operations in the same order), be
coalesced, and be what the dense tensors sum to. gloo fails on float16 and bool (torch's sparse
add has no CPU kernel for them), where torus coalesces every rank's entries at once. Every dtype sparse tensors take, coalesced and
uncoalesced inputs, hybrid tensors (dense dims), empty ones on some or all ranks, world sizes
1-4; DDP with a sparse embedding trains to gloo's parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import expectations
import harness
from reference import DTYPES

SIZE = (7, 5)  # sparse dims first; a hybrid tensor adds one dense dim of 3


def _rank_tensor(rank: int, dtype: torch.dtype, coalesced: bool, hybrid: bool, nnz: int) -> torch.Tensor:
    """A sparse tensor of rank `rank`: duplicate indices within it (unless coalesced) and with
    other ranks' tensors."""
    g = torch.Generator().manual_seed(17 + rank)
    indices = torch.stack([torch.randint(0, SIZE[0], (nnz,), generator=g), torch.randint(0, SIZE[1], (nnz,), generator=g)])
    value_shape = (nnz, 3) if hybrid else (nnz,)
    if dtype == torch.bool:
        values = torch.rand(value_shape, generator=g) < 0.5
    elif dtype.is_floating_point:
        values = (torch.randn(value_shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    else:
        values = torch.randint(0, 50, value_shape, generator=g).to(dtype)
    t = torch.sparse_coo_tensor(indices, values, SIZE + ((3,) if hybrid else ()))
    return t.coalesce() if coalesced else t


def _reference(tensors):
    """gloo's sum: coalesced inputs, added in rank order, coalesced. float16 and bool, which
    torch's sparse add does not take on the CPU: every rank's entries coalesced at once."""
    parts = [t.coalesce() for t in tensors]
    if parts[0].dtype in (torch.float16, torch.bool):
        return torch.sparse_coo_tensor(torch.cat([p.indices() for p in parts], 1), torch.cat([p.values() for p in parts]),
                                       parts[0].shape).coalesce()
    total = torch.sparse_coo_tensor(parts[0].indices(), parts[0].values(), parts[0].shape)
    for p in parts[1:]:
        total += torch.sparse_coo_tensor(p.indices(), p.values(), p.shape)
    return total.coalesce()


def _compare(result: torch.Tensor, expected: torch.Tensor, label: str):
    if not result.is_sparse:
        return [f"{label}: the result is not sparse ({result.layout})"]
    if not result.is_coalesced():
        return [f"{label}: the result is not coalesced"]
    if result.dtype != expected.dtype or result.shape != expected.shape:
        return [f"{label}: the result is {result.dtype} {tuple(result.shape)}, "
                f"expected {expected.dtype} {tuple(expected.shape)}"]
    if not torch.equal(result.indices(), expected.indices()):
        return [f"{label}: indices differ: {result.indices().tolist()} != {expected.indices().tolist()}"]
    if not torch.equal(result.values(), expected.values()):
        return [f"{label}: values differ from gloo's sum: {result.values()} != {expected.values()}"]
    return []


def _case_sparse(ctx, dtype_name, coalesced, hybrid, nnz_by_rank):
    dtype = getattr(torch, dtype_name)
    tensors = [_rank_tensor(r, dtype, coalesced, hybrid, nnz_by_rank[r % len(nnz_by_rank)])
               for r in range(ctx.world_size)]
    t = tensors[ctx.rank].clone()
    label = f"{dtype_name} {'coalesced' if coalesced else 'uncoalesced'}{' hybrid' if hybrid else ''} nnz={nnz_by_rank}"
    try:
        work = dist.all_reduce(t, async_op=True)
        work.wait()
    except Exception as error:  # noqa: BLE001 - a backend that refuses is reported, not crashed
        return [f"{label}: raised {type(error).__name__}: {error}"]
    expected = _reference(tensors)
    problems = _compare(t, expected, label)
    if not problems and not torch.equal(work.get_future().value()[0].to_dense(), expected.to_dense()):
        problems.append(f"{label}: the work's future does not hold the result")
    if not problems and dtype.is_floating_point:
        dense = sum(x.to_dense().double() for x in tensors)
        if not torch.allclose(t.to_dense().double(), dense, rtol=1e-2, atol=1e-2):
            problems.append(f"{label}: the result is not the sum of the dense tensors")
    dist.barrier()  # the group is still in step
    return problems


def _gap(backend, dtype_name, world_size):
    return expectations.gap(backend, "sparse_all_reduce", dtype_name, "SUM", world_size)


@pytest.mark.parametrize("hybrid", [False, True], ids=["sparse", "hybrid"])
@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "uncoalesced"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_all_reduce_dtypes(backend, dtype, coalesced, hybrid):
    harness.check(backend, 3, _case_sparse, dtype, coalesced, hybrid, [6, 9, 4], gap=_gap(backend, dtype, 3))


@pytest.mark.parametrize("nnz_by_rank", [[5], [0], [0, 6], [1, 0, 12]], ids=["some", "empty", "empty_on_some", "uneven"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"ws{w}")
def test_sparse_all_reduce_world_sizes(backend, world_size, nnz_by_rank):
    harness.check(backend, world_size, _case_sparse, "float32", False, False, nnz_by_rank,
                  gap=_gap(backend, "float32", world_size))


def _case_sparse_subgroup(ctx):
    """On a subgroup of ranks 1 and 2: group rank 0 is global rank 1."""
    group = ctx.new_group([1, 2])
    if ctx.rank not in (1, 2):
        return []
    tensors = [_rank_tensor(r, torch.float64, False, False, 5) for r in (1, 2)]
    t = tensors[ctx.rank - 1].clone()
    dist.all_reduce(t, group=group)
    return _compare(t, _reference(tensors), "subgroup [1, 2]")


def test_sparse_all_reduce_subgroup(backend):
    harness.check(backend, 3, _case_sparse_subgroup)


def _case_sparse_mismatched_sizes(ctx):
    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (4 + ctx.rank,))
    try:
        dist.all_reduce(t)
    except Exception as error:  # noqa: BLE001 - the error is what is checked
        return [] if "size" in str(error) else [f"the error does not name the size: {error}"]
    return ["all_reduce of sparse tensors of different sizes returned"]


def test_sparse_all_reduce_mismatched_sizes(backend):
    harness.check(backend, 2, _case_sparse_mismatched_sizes, gap=expectations.gap(backend, "sparse_all_reduce.mismatch"))
    harness.discard_pool(backend, 2)  # the failed call may have left the group out of step


# ---------------------------------------------------------------------------------------- DDP

STEPS = 4


class SparseEmbeddingNet(nn.Module):
    """A recommendation model's shape: a sparse embedding table, a dense head."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids, offsets):
        return self.head(self.embedding(ids, offsets))


def _train(ctx, group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(SparseEmbeddingNet(), process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        ids = torch.randint(0, 50, (12,), generator=g)  # ranks share some ids: duplicates across ranks
        offsets = torch.tensor([0, 3, 7])
        target = torch.randint(0, 3, (3,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(ids, offsets), target).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _case_ddp_sparse_embedding(ctx):
    gloo = dist.new_group(backend="gloo")
    mine, theirs = _train(ctx, None), _train(ctx, gloo)
    problems = []
    for name, p, q in zip(("embedding.weight", "head.weight", "head.bias"), mine, theirs):
        if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
            problems.append(f"{ctx.backend} vs gloo: {name} differs, max |diff| {(p - q).abs().max().item():.3g}")
    return problems


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"ws{w}")
def test_ddp_sparse_embedding_matches_gloo(backend, world_size):
    harness.check(backend, world_size, _case_ddp_sparse_embedding, timeout=120)
