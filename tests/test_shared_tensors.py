"""Tensors from the backend's allocate_tensor (c10d's tensor allocation hook, where FSDP2 takes
its communication buffers) live in shared memory this host's peers map (SharedTensorArena), and
the single-copy collectives read and write them with plain loads and stores. Checked here: what
allocate_tensor returns, that peers really map each other's tensors, and every result against a
reference, with every rank's buffer in shared memory, with only some ranks' (the others copied
through the kernel), and with views that start inside a segment. A peer killed while others
work on its mapped tensor: test_faults.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import harness
from reference import check_reduction, compare, gen, redop

SHM = "torus+shm"
CPU = torch.device("cpu")
SEGMENT_NAME = "/memfd:torus-tensors"


def _tensor_segments() -> dict[int, list[tuple[int, int]]]:
    """This process's mappings of shared tensor segments (its own and its peers'), by inode."""
    segments: dict[int, list[tuple[int, int]]] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == SEGMENT_NAME:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                segments.setdefault(int(fields[4]), []).append((start, end))
    return segments


def _segment_of(tensor: torch.Tensor) -> int | None:
    address = tensor.data_ptr()
    for inode, ranges in _tensor_segments().items():
        if any(start <= address < end for start, end in ranges):
            return inode
    return None


def _allocate(count: int, dtype: torch.dtype) -> torch.Tensor:
    backend = dist.group.WORLD._get_backend(CPU)
    return backend.allocate_tensor(count, dtype=dtype, device=CPU)


def _case_allocate_tensor(ctx):
    problems = []
    backend = dist.group.WORLD._get_backend(CPU)
    if not backend.supports_tensor_alloc(CPU):
        problems.append("supports_tensor_alloc(cpu) is False")
    for count, dtype in [(0, torch.float32), (10, torch.int64), (16383, torch.float32), (1 << 14, torch.float32),
                         ((1 << 20) + 3, torch.bfloat16), (3 << 20, torch.float64)]:
        t = _allocate(count, dtype)
        label = f"allocate_tensor({count}, {dtype})"
        if t.shape != (count,) or t.dtype != dtype or t.device != CPU or not t.is_contiguous():
            problems.append(f"{label}: got {t.shape}, {t.dtype}, {t.device}, contiguous {t.is_contiguous()}")
        shared = _segment_of(t) is not None
        if shared != (count * t.element_size() >= 64 * 1024):
            problems.append(f"{label}: in a shared tensor segment: {shared}")
        t.fill_(1)
        if count and not torch.all(t == 1):
            problems.append(f"{label}: does not hold what was written")
    # The storage grows and shrinks as torch's own does (FSDP2 frees and regrows its buffers).
    t = _allocate(1 << 16, torch.float32)
    t.copy_(torch.arange(1 << 16, dtype=torch.float32))
    t.resize_(1 << 18)
    if not torch.equal(t[: 1 << 16], torch.arange(1 << 16, dtype=torch.float32)):
        problems.append("resize_ lost the tensor's values")
    t.untyped_storage().resize_(0)
    # A freed segment serves the next allocation that fits it.
    first = _allocate(1 << 20, torch.float32)
    address = first.data_ptr()
    del first
    again = _allocate(1 << 20, torch.float32)
    if again.data_ptr() != address:
        problems.append("a freed 4 MiB tensor's segment was not reused for the next 4 MiB tensor")
    with pytest.raises(RuntimeError, match="negative"):
        _allocate(-1, torch.float32)
    return problems


def test_allocate_tensor_gives_tensors_in_shared_memory():
    harness.check(SHM, 2, _case_allocate_tensor)


def _buffer(shared: bool, count: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """count elements, in a shared tensor segment or in torch's memory, starting `offset`
    elements into their allocation."""
    whole = _allocate(count + offset, dtype) if shared else torch.empty(count + offset, dtype=dtype)
    return whole[offset:]


def _case_collectives(ctx, placement, dtype_name, op):
    from reference import dtype_of

    import torch_torus

    n, rank = ctx.world_size, ctx.rank
    group = ctx.new_group(list(range(n)), pg_options=torch_torus.Options(
        allreduce="two_shot", allgather="direct", reduce_scatter="direct"))
    shared = placement in ("all", "views") or (placement == "some" and rank % 2 == 0)
    offset = 0 if placement != "views" else 17 + rank
    dtype = dtype_of(dtype_name)
    problems = []
    for count in (1 << 16, (1 << 20) + 4 * n + 1):
        key = ("shared-tensors", placement, dtype_name, op, count)
        label = f"{placement} {dtype_name} {op} {count}"
        inputs = [gen(key, r, (count,), dtype_name, op) for r in range(n)]

        t = _buffer(shared, count, dtype, offset)
        t.copy_(inputs[rank])
        dist.all_reduce(t, op=redop(op), group=group)
        problems += check_reduction(t, inputs, op, f"all_reduce {label}")

        block = count // n
        source = _buffer(shared, block * n, dtype, offset)
        source.copy_(torch.cat([x[: block * n] for x in inputs]).view(n, -1)[rank])
        gathered = _buffer(shared, block * n * n, dtype, offset)
        dist.all_gather_into_tensor(gathered, source, group=group)
        expected = torch.cat([x[: block * n] for x in inputs])
        problems += compare(gathered, expected, label=f"all_gather {label}")

        whole = _buffer(shared, block * n, dtype, offset)
        whole.copy_(inputs[rank][: block * n])
        out = _buffer(shared, block, dtype, offset)
        dist.reduce_scatter_tensor(out, whole, op=redop(op), group=group)
        problems += check_reduction(out, [x[rank * block:(rank + 1) * block] for x in inputs], op,
                                    f"reduce_scatter {label}")
    # Every peer's allreduce buffer is mapped here (memfd inodes are the same in every process).
    segments = [None] * n
    dist.all_gather_object(segments, _segment_of(t), group=group)
    mapped = _tensor_segments()
    unmapped = [r for r in range(n) if r != rank and segments[r] is not None and segments[r] not in mapped]
    if unmapped:
        problems.append(f"{placement}: the shared tensors of ranks {unmapped} are not mapped here")
    if (segments[rank] is not None) != shared:
        problems.append(f"{placement}: this rank's buffer in a shared tensor segment: {segments[rank] is not None}")
    dist.destroy_process_group(group)
    return problems


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("placement", ["all", "some", "views"])
@pytest.mark.parametrize("dtype_name,op", [("float32", "SUM"), ("bfloat16", "AVG"), ("int64", "MAX"),
                                           ("float64", "PREMUL_SUM")])
def test_collectives_on_shared_tensors_match_the_reference(world_size, placement, dtype_name, op):
    """all: every rank's buffers from allocate_tensor; some: even ranks' only (odd ranks' peers
    are copied through the kernel, even ranks' read directly); views: slices that start inside
    their segment, at another offset on every rank."""
    harness.check(SHM, world_size, _case_collectives, placement, dtype_name, op)


def _train_fsdp2(group, from_backend: bool) -> tuple[list[float], dict]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in (*model, model):  # each fully_shard module's own setting
        module.set_allocate_memory_from_process_group_for_comm(from_backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1 + dist.get_rank(group))
    losses = []
    for _ in range(3):
        loss = model(torch.randn(8, 256, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: value.full_tensor() for name, value in model.state_dict().items()}


def _case_fsdp2(ctx):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    group = ctx.new_group(list(range(ctx.world_size)))
    allocate = _fsdp_collectives.ProcessGroupAllocMixin.allocate
    in_segments = []

    def recording(self, *args, **kwargs):
        tensor = allocate(self, *args, **kwargs)
        in_segments.append(_segment_of(tensor) is not None)
        return tensor

    _fsdp_collectives.ProcessGroupAllocMixin.allocate = recording
    try:
        shared_losses, shared_state = _train_fsdp2(group, from_backend=True)
    finally:
        _fsdp_collectives.ProcessGroupAllocMixin.allocate = allocate
    losses, state = _train_fsdp2(group, from_backend=False)
    problems = [] if in_segments and all(in_segments) else [
        f"FSDP2's buffers in shared tensor segments: {in_segments}"]
    if shared_losses != losses:
        problems.append(f"losses {shared_losses} with allocate_tensor's buffers, {losses} without")
    for name in state:
        problems += compare(shared_state[name], state[name], label=name)
    dist.destroy_process_group(group)
    return problems


def test_fsdp2_with_buffers_from_allocate_tensor_trains_as_without():
    """FSDP2's opt-in (set_allocate_memory_from_process_group_for_comm) takes its all-gather and
    reduce-scatter buffers from allocate_tensor: the same losses and parameters, bit for bit."""
    harness.check(SHM, 4, _case_fsdp2)


SEGMENT = 2 << 20
BASE = 1 << 40


@pytest.mark.parametrize("address,nbytes,base,size,wrong", [
    (BASE, SEGMENT, BASE, SEGMENT, None),
    (BASE + 4096, 100, BASE, SEGMENT, None),
    (BASE + SEGMENT, 0, BASE, SEGMENT, None),
    (BASE - 1, 10, BASE, SEGMENT, "before its start"),
    (BASE + SEGMENT - 10, 11, BASE, SEGMENT, "past its end"),
    (2 ** 64 - 8, 16, BASE, SEGMENT, "an address that wraps"),
    (BASE, 10, 2 ** 64 - 4096, 8192, "a segment that wraps"),
])
def test_a_posting_outside_its_segment_is_refused(address, nbytes, base, size, wrong):
    """A peer's posting is input: its buffer must lie inside the segment it names, else the
    collective fails naming the numbers instead of touching memory past the segment."""
    import torus_testing

    problem = torus_testing.module().shared_tensor_claim_problem(address, nbytes, base, size)
    if wrong is None:
        assert problem == "", problem
    else:
        assert problem == (f"posted {nbytes} bytes at {address}, outside the shared tensor segment it named "
                           f"({size} bytes at {base})"), (wrong, problem)


@pytest.mark.parametrize("target,file_bytes,wrong", [
    ("/memfd:torus-tensors (deleted)", SEGMENT, None),
    ("/memfd:torus-shm (deleted)", SEGMENT, "an fd that is /memfd:torus-shm (deleted)"),
    ("/home/user/data.bin", SEGMENT, "an fd that is /home/user/data.bin"),
    ("/memfd:torus-tensors (deleted)", SEGMENT // 2, f"of {SEGMENT} bytes whose file holds {SEGMENT // 2}"),
])
def test_an_fd_that_is_not_the_segment_named_is_refused(target, file_bytes, wrong):
    """The fd a peer names must be one of its shared tensor segments, of the size it says:
    another of its files (its transport's own segment, a data file) or a smaller one fails."""
    import torus_testing

    problem = torus_testing.module().shared_tensor_file_problem(target, file_bytes, SEGMENT)
    assert (problem == "") if wrong is None else (wrong in problem), problem
