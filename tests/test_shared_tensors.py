"""Tensors from the backend's allocate_tensor (c10d's tensor allocation hook, where FSDP2 takes
its communication buffers) live in shared memory this host's peers map (SharedTensorArena), and
the single-copy collectives read and write them with plain loads and stores. Checked here: what
allocate_tensor returns, that peers really map each other's tensors, and every result against a
reference, with every rank's buffer in shared memory, with only some ranks' (the others copied
through the kernel), and with views that start inside a segment. A peer killed while others
work on its mapped tensor: test_faults.py."""

from __future__ import annotations

import multiprocessing
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


# ------------------------------------------------------- what the arena keeps, and fork

def _own_segment_fds() -> dict[int, int]:
    """This process's open fds of shared tensor segments: inode by fd."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith(SEGMENT_NAME):
                found[int(name)] = os.stat(f"/proc/self/fd/{name}").st_ino
        except OSError:  # closed meanwhile (listdir's own fd among them)
            pass
    return found


def _case_bounded_cache(ctx, sizes):
    import torch_torus

    n, rank = ctx.world_size, ctx.rank
    limit = 1 << 20
    group = ctx.new_group(list(range(n)), pg_options=torch_torus.Options(
        allreduce="two_shot", shared_tensor_cache=str(limit)))
    problems = []
    stats = torch_torus.shared_memory_stats()
    if stats["limit_bytes"] != limit or stats["free_bytes"] > limit:
        problems.append(f"with TORUS_SHARED_TENSOR_CACHE={limit} the arena keeps {stats}")
    inodes = set()
    for step, count in enumerate(sizes):
        t = _allocate(count, torch.float32)
        inodes.add(_segment_of(t))
        t.fill_(step + rank)
        dist.all_reduce(t, group=group)
        if not torch.all(t == n * step + n * (n - 1) // 2):
            problems.append(f"all_reduce of {count} floats (step {step}) gave {t[:4].tolist()}...")
        del t
        stats = torch_torus.shared_memory_stats()
        if stats["free_bytes"] > limit or stats["live_bytes"] != 0:
            problems.append(f"after freeing {count} floats the arena keeps {stats}")
    if torch_torus.shared_memory_stats()["released_segments"] == 0:
        problems.append("no segment was given back")
    torch_torus.empty_cache()
    stats = torch_torus.shared_memory_stats()
    fds = _own_segment_fds()
    if stats["free_bytes"] or stats["free_segments"] or stats["live_segments"] or fds:
        problems.append(f"after empty_cache: {stats}, segment fds open {sorted(fds)}")
    # Every rank gave its segments back before this collective's postings: each peer unmaps them.
    dist.barrier(group=group)
    dist.all_reduce(torch.ones(1 << 16), group=group)
    everyone = [None] * n
    dist.all_gather_object(everyone, inodes - {None}, group=group)
    still = set().union(*everyone) & set(_tensor_segments())
    if still:
        problems.append(f"given-back segments still mapped here (inodes {sorted(still)})")
    dist.destroy_process_group(group)
    return problems


def test_freed_segments_are_kept_up_to_the_limit_and_given_back_on_empty_cache():
    """40 sizes (64 KiB to 8 MiB, as issue 55's cycle to 1.8 GB, scaled down) through
    allocate_tensor and a two_shot allreduce each: after every free the arena keeps at most
    TORUS_SHARED_TENSOR_CACHE; empty_cache() leaves no segment and no fd of one, and after the
    next collective no peer maps any of them."""
    sizes = [int(16384 * (128 ** (i / 39))) for i in range(40)]
    harness.check(SHM, 2, _case_bounded_cache, sizes)


def _case_fd_reused(ctx):
    import torch_torus

    n, rank = ctx.world_size, ctx.rank
    group = ctx.new_group(list(range(n)), pg_options=torch_torus.Options(allreduce="two_shot",
                                                                         shared_tensor_cache="0"))
    problems, fds = [], []
    for step in range(6):
        t = _allocate(1 << 18, torch.float32)
        inode = _segment_of(t)
        fds += [fd for fd, node in _own_segment_fds().items() if node == inode]
        t.fill_(10 * step + rank)
        dist.all_reduce(t, group=group)
        expected = n * 10 * step + n * (n - 1) // 2
        if not torch.all(t == expected):
            problems.append(f"step {step}: all_reduce gave {t[:4].tolist()}..., expected {expected}")
        del t
    if len(set(fds)) == len(fds):
        problems.append(f"no segment took a given-back one's fd (fds {fds}): the case proves nothing")
    dist.destroy_process_group(group)
    return problems


def test_a_segment_under_a_given_back_ones_fd_is_mapped_anew():
    """With nothing kept (TORUS_SHARED_TENSOR_CACHE=0) each freed segment is closed, and the next
    one of the same size takes its fd (and often its address): a peer must map the new segment,
    not read the old one's pages through its cached mapping."""
    harness.check(SHM, 2, _case_fd_reused)


def _case_last_group(ctx):
    import torch_torus

    problems = []
    kept = _allocate(1 << 20, torch.float32)
    freed = _allocate(1 << 20, torch.float32)
    del freed
    before = torch_torus.shared_memory_stats()
    if before["free_segments"] != 1:
        problems.append(f"a freed tensor's segment was not kept: {before}")
    dist.destroy_process_group()
    after = torch_torus.shared_memory_stats()
    if after["free_bytes"] or after["limit_bytes"] or after["live_segments"] != 1:
        problems.append(f"after the last group was destroyed: {after}")
    del kept
    if torch_torus.shared_memory_stats()["live_segments"] or _own_segment_fds():
        problems.append(f"a tensor freed with no group left was kept: {torch_torus.shared_memory_stats()}")
    return problems


def test_destroying_the_last_group_gives_back_every_free_segment():
    harness.conclude(harness.problems(harness.run_job(SHM, 2, _case_last_group, init="file")))


class _Touching(torch.utils.data.Dataset):
    """Each item, in a forked worker of its own: reads and overwrites the parent's shared tensor,
    and takes a tensor of its own from allocate_tensor."""

    def __init__(self, parents: torch.Tensor):
        self.parents = parents

    def __len__(self):
        return 2  # one item per worker (DataLoader deals them round-robin)

    def __getitem__(self, index):
        import torch_torus

        seen = self.parents[0].item()
        self.parents.fill_(42.0)
        own = _allocate(1 << 20, torch.float32)
        own.fill_(index)
        return {"seen": seen, "written": self.parents[0].item(), "own": own, "inode": _segment_of(own),
                "stats": torch_torus.shared_memory_stats(), "fds": len(_own_segment_fds())}


def _case_fork(ctx):
    problems = []
    parents = _allocate(1 << 16, torch.float32).fill_(2.0)
    freed = _allocate(1 << 20, torch.float32)
    freed_address, freed_inode = freed.data_ptr(), _segment_of(freed)
    del freed
    loader = torch.utils.data.DataLoader(_Touching(parents), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    # The harness's ranks are daemonic processes, which multiprocessing forbids children; a
    # training script's ranks are not.
    config = multiprocessing.current_process()._config
    daemonic = config.get("daemon")
    config["daemon"] = False
    try:
        items = list(loader)
    finally:
        config["daemon"] = daemonic
    for index, item in enumerate(items):
        if item["seen"] != 2.0 or item["written"] != 42.0:
            problems.append(f"item {index}: the child read {item['seen']} and then {item['written']}")
        if item["inode"] is None or item["inode"] == freed_inode:
            problems.append(f"item {index}: the child's tensor is in segment {item['inode']} "
                            f"(the parent's free one: {freed_inode})")
        stats = item["stats"]
        if stats["live_segments"] != 1 or stats["free_segments"] or item["fds"] != 1:
            problems.append(f"item {index}: the child's arena holds {stats}, {item['fds']} segment fds")
        if not torch.all(item["own"] == index):
            problems.append(f"item {index}: the child's tensor arrived as {item['own'][:4].tolist()}...")
    if not torch.all(parents == 2.0):
        problems.append(f"the children's writes reached the parent's tensor: {parents[:4].tolist()}...")
    again = _allocate(1 << 20, torch.float32)
    if again.data_ptr() != freed_address or _segment_of(again) != freed_inode:
        problems.append("after the workers the parent's free segment was not reused")
    return problems


def test_a_forked_dataloader_worker_neither_writes_into_nor_allocates_from_the_parents_segments():
    """DataLoader workers forked (num_workers=2, fork) from a rank: a write to the parent's shared
    tensor stays in the child (copy-on-write, as torch's own memory), the child's allocate_tensor
    gets a segment of its own (never the parent's free one), its arena holds only that, and the
    parent's arena is as before."""
    harness.check(SHM, 2, _case_fork)
