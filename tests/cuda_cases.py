"""The cases of tests/test_cuda.py, run on every rank: every collective and send/recv on device
tensors against CPU references, stream semantics, the caching allocator, DDP, callbacks, PowerSGD,
the timeout, and a build without the CUDA path. test_cuda.py runs them on a GPU;
test_device_path.py runs the same cases on the host device layer (TORUS_HOST_DEVICE=on), where
_on_shared_gpu gives the CPU."""

from __future__ import annotations

import datetime
import functools
import os
import re
import time
import warnings

import torch
import torch.distributed as dist

import torch_torus
from reference import check_reduction, compare, dtype_of, first_line, fmt_shape, gen, gen_all, redop

# True exactly when torch_torus._C was built with its CUDA path (torch with CUDA and a CUDA
# toolkit at build time, TORUS_BUILD_CUDA not 0): then torus takes CUDA tensors in every
# collective and the cases below run against it as they run against gloo. Without it a CUDA
# tensor raises NO_CUDA_PATH (test_cuda_tensor_rejected_without_cuda_path).
TORUS_ACCEPTS_CUDA = bool(torch_torus._C.built_with_cuda)
NO_CUDA_PATH = "is a CUDA tensor, but this build of torch_torus has no CUDA path"
WITHOUT_CUDA_PATH = ("torch_torus was built without its CUDA path (torch_torus._C.built_with_cuda "
                     "is False: torch without CUDA, no CUDA toolkit, or TORUS_BUILD_CUDA=0)")


def _on_shared_gpu(ctx) -> torch.device:
    """Every rank on GPU 0: several ranks sharing one device, which NCCL refuses. Under the host
    device layer (tests/test_device_path.py runs these cases there) the CPU, whose tensors then
    take the device path."""
    if ctx.state.get("host device"):
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _synchronize(device: torch.device) -> None:
    """The host waits for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _attempt(label: str, problems: list, call) -> bool:
    """call(); an exception becomes a problem naming `label`. False if it raised."""
    try:
        call()
        return True
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        problems.append(f"{label}: raised {first_line(e)}")
        return False


def _case_cuda_allreduce(ctx, dtype, op):
    device = _on_shared_gpu(ctx)
    problems = []
    for count in (0, 1, 7, 4099, 1 << 20):
        inputs = gen_all(("cuda allreduce", dtype, op, count), ctx.world_size, (count,), dtype, op)
        t = inputs[ctx.rank].to(device, copy=True)
        dist.all_reduce(t, op=redop(op))
        problems += check_reduction(t.cpu(), inputs, op, f"{dtype} {op} count={count}")
    return problems


# Every other collective on CUDA tensors. Shapes: empty, a scalar where the collective takes one,
# one element, an odd count (4099: not a multiple of any vector width, nor of 16 bytes in
# bfloat16 or uint8), and two dimensions.
CUDA_SHAPES = [(0,), (), (1,), (4099,), (3, 5)]
CUDA_ROW_SHAPES = [shape for shape in CUDA_SHAPES if shape]  # collectives that split dim 0


def _rows(pattern: str, src: int, dst: int) -> int:
    """Rows that rank src sends to rank dst in all_to_all: the same for every pair, or uneven
    (zero for some pairs, 1031 to 3093 for the others)."""
    return 3 if pattern == "even" else ((src * 7 + dst * 3) % 4) * 1031


def _cc_all_reduce_coalesced(ctx, device, dtype, problems):
    n, rank = ctx.world_size, ctx.rank
    inputs = [gen_all(("cuda arc", shape), n, shape, dtype) for shape in CUDA_SHAPES]
    tensors = [per_rank[rank].to(device, copy=True) for per_rank in inputs]
    label = f"all_reduce_coalesced {dtype} shapes {[fmt_shape(s) for s in CUDA_SHAPES]}"

    def call():
        with warnings.catch_warnings():  # torch: "all_reduce_coalesced will be deprecated"
            warnings.simplefilter("ignore", FutureWarning)
            if hasattr(dist, "all_reduce_coalesced"):
                dist.all_reduce_coalesced(tensors)
            else:  # the c10d call it wraps
                opts = dist.AllreduceCoalescedOptions()
                opts.reduceOp = dist.ReduceOp.SUM
                dist.distributed_c10d._get_default_group().allreduce_coalesced(tensors, opts).wait()

    if _attempt(label, problems, call):
        for shape, t, per_rank in zip(CUDA_SHAPES, tensors, inputs):
            problems += check_reduction(t.cpu(), per_rank, "SUM",
                                        f"all_reduce_coalesced {dtype} shape={fmt_shape(shape)}")


def _cc_reduce(ctx, device, dtype, problems):
    """To roots other than 0; a non-root's tensor is left as it was (NCCL's semantics)."""
    n, rank = ctx.world_size, ctx.rank
    for root in sorted({1, n - 1}):
        for shape in CUDA_SHAPES:
            inputs = gen_all(("cuda reduce", root, shape), n, shape, dtype)
            t = inputs[rank].to(device, copy=True)
            label = f"reduce dst={root} {dtype} shape={fmt_shape(shape)}"
            if not _attempt(label, problems, lambda: dist.reduce(t, dst=root)):
                return
            if rank == root:
                problems += check_reduction(t.cpu(), inputs, "SUM", label)
            elif not torch.equal(t.cpu(), inputs[rank]):
                problems.append(f"{label}: the tensor changed on non-root rank {rank}")


def _cc_all_gather(ctx, device, dtype, problems):
    n, rank = ctx.world_size, ctx.rank
    for shape in CUDA_SHAPES:
        inputs = gen_all(("cuda ag", shape), n, shape, dtype)
        x = inputs[rank].to(device, copy=True)
        outs = [torch.empty(shape, dtype=dtype_of(dtype), device=device) for _ in range(n)]
        label = f"all_gather {dtype} shape={fmt_shape(shape)}"
        if not _attempt(label, problems, lambda: dist.all_gather(outs, x)):
            return
        for j in range(n):
            problems += compare(outs[j].cpu(), inputs[j], None, f"{label} output[{j}]")
        problems += compare(x.cpu(), inputs[rank], None, f"{label} (input changed)")


def _cc_all_gather_into_tensor(ctx, device, dtype, problems):
    n, rank = ctx.world_size, ctx.rank
    for shape in CUDA_ROW_SHAPES:
        inputs = gen_all(("cuda agt", shape), n, shape, dtype)
        out = torch.empty((shape[0] * n,) + shape[1:], dtype=dtype_of(dtype), device=device)
        x = inputs[rank].to(device, copy=True)
        label = f"all_gather_into_tensor {dtype} shape={fmt_shape(shape)}"
        if not _attempt(label, problems, lambda: dist.all_gather_into_tensor(out, x)):
            return
        problems += compare(out.cpu(), torch.cat(inputs), None, label)


def _cc_gather(ctx, device, dtype, problems):
    n, rank = ctx.world_size, ctx.rank
    root = 1
    for shape in CUDA_SHAPES:
        inputs = gen_all(("cuda gather", shape), n, shape, dtype)
        x = inputs[rank].to(device, copy=True)
        outs = ([torch.empty(shape, dtype=dtype_of(dtype), device=device) for _ in range(n)]
                if rank == root else None)
        label = f"gather dst={root} {dtype} shape={fmt_shape(shape)}"
        if not _attempt(label, problems, lambda: dist.gather(x, outs, dst=root)):
            return
        if rank == root:
            for j in range(n):
                problems += compare(outs[j].cpu(), inputs[j], None, f"{label} from rank {j}")


def _cc_scatter(ctx, device, dtype, problems):
    n, rank = ctx.world_size, ctx.rank
    root = n - 1
    for shape in CUDA_SHAPES:
        pieces = [gen(("cuda scatter", shape, j), root, shape, dtype) for j in range(n)]
        ins = [p.to(device, copy=True) for p in pieces] if rank == root else None
        out = gen(("cuda scatter out", shape), rank, shape, dtype).to(device, copy=True)
        label = f"scatter src={root} {dtype} shape={fmt_shape(shape)}"
        if not _attempt(label, problems, lambda: dist.scatter(out, ins, src=root)):
            return
        problems += compare(out.cpu(), pieces[rank], None, label)


def _reduce_scatter_inputs(ctx, shape, dtype):
    """This rank's piece for every rank, and the contributions every rank makes to this rank's
    output: piece j on rank r is gen((key, j), r)."""
    n, rank = ctx.world_size, ctx.rank
    mine = [gen(("cuda rs", shape, j), rank, shape, dtype) for j in range(n)]
    contributions = gen_all(("cuda rs", shape, rank), n, shape, dtype)
    return mine, contributions


def _cc_reduce_scatter(ctx, device, dtype, problems):
    for shape in CUDA_SHAPES:
        mine, contributions = _reduce_scatter_inputs(ctx, shape, dtype)
        ins = [piece.to(device, copy=True) for piece in mine]
        out = torch.empty(shape, dtype=dtype_of(dtype), device=device)
        label = f"reduce_scatter {dtype} shape={fmt_shape(shape)}"
        if not _attempt(label, problems, lambda: dist.reduce_scatter(out, ins)):
            return
        problems += check_reduction(out.cpu(), contributions, "SUM", label)


def _cc_reduce_scatter_tensor(ctx, device, dtype, problems):
    for shape in CUDA_ROW_SHAPES:
        mine, contributions = _reduce_scatter_inputs(ctx, shape, dtype)
        x = torch.cat(mine).to(device, copy=True)
        out = torch.empty(shape, dtype=dtype_of(dtype), device=device)
        label = f"reduce_scatter_tensor {dtype} shape={fmt_shape(shape)}"
        if not _attempt(label, problems, lambda: dist.reduce_scatter_tensor(out, x)):
            return
        problems += check_reduction(out.cpu(), contributions, "SUM", label)


def _cc_all_to_all(ctx, device, dtype, problems, pattern):
    n, rank = ctx.world_size, ctx.rank
    ins = [gen(("cuda a2a", pattern, rank, j), rank, (_rows(pattern, rank, j), 2), dtype).to(device, copy=True)
           for j in range(n)]
    outs = [torch.empty((_rows(pattern, i, rank), 2), dtype=dtype_of(dtype), device=device)
            for i in range(n)]
    label = f"all_to_all(list) {dtype} {pattern}"
    if not _attempt(label, problems, lambda: dist.all_to_all(outs, ins)):
        return
    for i in range(n):
        expected = gen(("cuda a2a", pattern, i, rank), i, (_rows(pattern, i, rank), 2), dtype)
        problems += compare(outs[i].cpu(), expected, None, f"{label} from rank {i}")


def _cc_all_to_all_single(ctx, device, dtype, problems, pattern):
    n, rank = ctx.world_size, ctx.rank
    in_splits = [_rows(pattern, rank, j) for j in range(n)]
    out_splits = [_rows(pattern, i, rank) for i in range(n)]
    x = torch.cat([gen(("cuda a2as", pattern, rank, j), rank, (in_splits[j], 2), dtype)
                   for j in range(n)]).to(device, copy=True)
    out = torch.zeros((sum(out_splits), 2), dtype=dtype_of(dtype), device=device)
    kw = {} if pattern == "even" else {"output_split_sizes": out_splits, "input_split_sizes": in_splits}
    label = f"all_to_all_single {dtype} {pattern} in_splits={in_splits} out_splits={out_splits}"
    if not _attempt(label, problems, lambda: dist.all_to_all_single(out, x, **kw)):
        return
    expected = torch.cat([gen(("cuda a2as", pattern, i, rank), i, (out_splits[i], 2), dtype)
                          for i in range(n)])
    problems += compare(out.cpu(), expected, None, label)


def _cc_broadcast(ctx, device, dtype, problems):
    n, rank = ctx.world_size, ctx.rank
    for root in range(n):
        for shape in CUDA_SHAPES:
            t = gen(("cuda bcast", root, shape), rank, shape, dtype).to(device, copy=True)
            label = f"broadcast src={root} {dtype} shape={fmt_shape(shape)}"
            if not _attempt(label, problems, lambda: dist.broadcast(t, src=root)):
                return
            problems += compare(t.cpu(), gen(("cuda bcast", root, shape), root, shape, dtype), None, label)


def _cc_barrier(ctx, device, dtype, problems):
    """With CUDA work of the group before it: nobody leaves a barrier before the late rank has
    arrived; async too; the CUDA result before it is right."""
    n, rank = ctx.world_size, ctx.rank
    t = torch.full((1 << 20,), float(rank + 1), device=device)
    if not _attempt("all_reduce before the barrier", problems, lambda: dist.all_reduce(t)):
        return
    directory = os.path.join(ctx.scratch, f"cuda-barrier-{ctx.state.setdefault('cuda barrier', 0)}")
    ctx.state["cuda barrier"] += 1
    os.makedirs(directory, exist_ok=True)
    for round_index in range(3):
        if rank == round_index % n:
            time.sleep(0.3)  # the late rank
        open(os.path.join(directory, f"{round_index}-{rank}"), "w").close()
        if not _attempt(f"barrier round {round_index}", problems, dist.barrier):
            return
        missing = [r for r in range(n) if not os.path.exists(os.path.join(directory, f"{round_index}-{r}"))]
        if missing:
            problems.append(f"barrier round {round_index}: left before rank(s) {missing} arrived")
    _attempt("barrier(async_op=True).wait()", problems, lambda: dist.barrier(async_op=True).wait())
    expected = float(n * (n + 1) // 2)
    if not bool((t == expected).all().cpu()):
        problems.append(f"all_reduce before the barrier: {t[:4].cpu().tolist()}, expected {expected}")


def _pairs_peer(ctx) -> int | None:
    """Ranks 2k and 2k+1 are partners; with an odd world size the last rank has none."""
    peer = ctx.rank ^ 1
    return peer if peer < ctx.world_size else None


P2P_SHAPES = [(0,), (), (1,), (4099,), (1 << 20,)]


def _cc_send_recv(ctx, device, dtype, problems):
    """Blocking send and recv between partners, both directions, the even rank first."""
    peer = _pairs_peer(ctx)
    if peer is None:
        return
    rank = ctx.rank
    for shape in P2P_SHAPES:
        mine = gen(("cuda p2p", shape), rank, shape, dtype).to(device, copy=True)
        buf = torch.zeros(shape, dtype=dtype_of(dtype), device=device)
        label = f"send/recv {rank}<->{peer} {dtype} shape={fmt_shape(shape)}"

        def exchange():
            if rank % 2 == 0:
                dist.send(mine, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(mine, peer)

        if not _attempt(label, problems, exchange):
            return
        problems += compare(buf.cpu(), gen(("cuda p2p", shape), peer, shape, dtype), None, label)


def _cc_isend_irecv(ctx, device, dtype, problems):
    """isend and irecv between partners, both directions at once."""
    peer = _pairs_peer(ctx)
    if peer is None:
        return
    rank = ctx.rank
    for shape in P2P_SHAPES:
        mine = gen(("cuda ip2p", shape), rank, shape, dtype).to(device, copy=True)
        buf = torch.zeros(shape, dtype=dtype_of(dtype), device=device)
        label = f"isend/irecv {rank}<->{peer} {dtype} shape={fmt_shape(shape)}"

        def exchange():
            receive = dist.irecv(buf, peer)
            send = dist.isend(mine, peer)
            send.wait()
            receive.wait()

        if not _attempt(label, problems, exchange):
            return
        problems += compare(buf.cpu(), gen(("cuda ip2p", shape), peer, shape, dtype), None, label)


def _cc_batch_isend_irecv(ctx, device, dtype, problems):
    """A ring exchange in both directions in one batch_isend_irecv."""
    n, rank = ctx.world_size, ctx.rank
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for shape in [(0,), (5,), (4099,), (1 << 20,)]:
        to_next = gen(("cuda batch fwd", shape), rank, shape, dtype).to(device, copy=True)
        to_prev = gen(("cuda batch bwd", shape), rank, shape, dtype).to(device, copy=True)
        from_prev = torch.zeros(shape, dtype=dtype_of(dtype), device=device)
        from_next = torch.zeros(shape, dtype=dtype_of(dtype), device=device)
        ops = [dist.P2POp(dist.isend, to_next, nxt), dist.P2POp(dist.irecv, from_prev, prv),
               dist.P2POp(dist.isend, to_prev, prv), dist.P2POp(dist.irecv, from_next, nxt)]
        label = f"batch_isend_irecv {dtype} shape={fmt_shape(shape)}"

        def go():
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        if not _attempt(label, problems, go):
            return
        problems += compare(from_prev.cpu(), gen(("cuda batch fwd", shape), prv, shape, dtype), None,
                            f"{label} from the previous rank")
        problems += compare(from_next.cpu(), gen(("cuda batch bwd", shape), nxt, shape, dtype), None,
                            f"{label} from the next rank")


CUDA_COLLECTIVES = {
    "all_reduce_coalesced": _cc_all_reduce_coalesced,
    "reduce": _cc_reduce,
    "all_gather": _cc_all_gather,
    "all_gather_into_tensor": _cc_all_gather_into_tensor,
    "gather": _cc_gather,
    "scatter": _cc_scatter,
    "reduce_scatter": _cc_reduce_scatter,
    "reduce_scatter_tensor": _cc_reduce_scatter_tensor,
    "all_to_all.even": functools.partial(_cc_all_to_all, pattern="even"),
    "all_to_all.uneven": functools.partial(_cc_all_to_all, pattern="uneven"),
    "all_to_all_single.even": functools.partial(_cc_all_to_all_single, pattern="even"),
    "all_to_all_single.uneven": functools.partial(_cc_all_to_all_single, pattern="uneven"),
    "broadcast": _cc_broadcast,
    "barrier": _cc_barrier,
    "send_recv": _cc_send_recv,
    "isend_irecv": _cc_isend_irecv,
    "batch_isend_irecv": _cc_batch_isend_irecv,
}
# Element sizes 4, 2 and 1 bytes; the barrier moves no data of its own.
CUDA_COLLECTIVE_CASES = [(name, dtype) for name in CUDA_COLLECTIVES
                         for dtype in (["float32"] if name == "barrier" else ["float32", "bfloat16", "uint8"])]


def _case_cuda_collective(ctx, name, dtype):
    """One collective on CUDA tensors against the CPU reference; a call that raises is a problem
    (and ends the case: the group may be out of step after it)."""
    device = _on_shared_gpu(ctx)
    problems: list = []
    CUDA_COLLECTIVES[name](ctx, device, dtype, problems)
    _synchronize(device)
    return problems


# 1 << 22 float32 elements (16 MiB) cross every chunk and arena boundary of the CUDA path.
LARGE_COUNTS = (0, 1, 4099, 1 << 22)


TRANSPOSED = (67, 64)  # stored as 67 x 64, passed as its 64 x 67 transpose: not contiguous


def _case_cuda_sizes_and_transposed(ctx, collective):
    """all_reduce or broadcast (every root in {0, n-1}) of float32 at odd and large counts, and of
    a transposed (non-contiguous) view."""
    device = _on_shared_gpu(ctx)
    n, rank = ctx.world_size, ctx.rank
    problems: list = []
    layouts = [((count,), False) for count in LARGE_COUNTS] + [(TRANSPOSED, True)]
    for shape, transposed in layouts:
        def view(t):
            return t.t() if transposed else t

        what = f"transposed {TRANSPOSED[1]}x{TRANSPOSED[0]}" if transposed else f"count={shape[0]}"
        if collective == "all_reduce":
            inputs = gen_all(("cuda big allreduce", shape), n, shape, "float32")
            t = view(inputs[rank].to(device, copy=True))
            if transposed and t.is_contiguous():
                problems.append("the transposed view is contiguous: the test does not test it")
            label = f"all_reduce float32 {what}"
            if not _attempt(label, problems, lambda: dist.all_reduce(t)):
                break
            problems += check_reduction(t.cpu(), [view(x) for x in inputs], "SUM", label)
            continue
        for root in sorted({0, n - 1}):
            t = view(gen(("cuda big bcast", shape, root), rank, shape, "float32").to(device, copy=True))
            label = f"broadcast src={root} float32 {what}"
            if not _attempt(label, problems, lambda: dist.broadcast(t, src=root)):
                return problems
            problems += compare(t.cpu(), view(gen(("cuda big bcast", shape, root), root, shape, "float32")),
                                None, label)
    _synchronize(device)
    return problems


STREAM_COLLECTIVES = ["all_reduce", "all_gather_into_tensor", "broadcast"]


STREAM_WAITS = ["wait", "future_wait", "future_then"]
STREAM_COUNT = 1 << 20
COMPLETION_DEADLINE_S = 30.0


def _stream_expected(collective: str, n: int) -> torch.Tensor:
    """What the collective leaves in its output when rank r's input is full(r + 1)."""
    if collective == "all_reduce":
        return torch.full((STREAM_COUNT,), float(n * (n + 1) // 2))
    if collective == "all_gather_into_tensor":
        return torch.cat([torch.full((STREAM_COUNT,), float(r + 1)) for r in range(n)])
    return torch.full((STREAM_COUNT,), float(n))  # broadcast from rank n - 1


def _case_stream_semantics(ctx, collective, how):
    """On a side stream the input is written by a copy queued behind a ~0.05-0.1 s GPU sleep, so
    the collective must wait for the stream's pending writes without the host waiting; after
    wait() / get_future().wait() the current stream reads the result without any host
    synchronization; a then() callback reads the output on its current stream and the chained
    future's value is seen by ours; is_completed() becomes true."""
    device = _on_shared_gpu(ctx)
    n, rank = ctx.world_size, ctx.rank
    problems = []
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        source = torch.full((STREAM_COUNT,), float(rank + 1), device=device)
        t = torch.zeros_like(source)
        out = torch.zeros(n * STREAM_COUNT, device=device) if collective == "all_gather_into_tensor" else t
        torch.cuda._sleep(100_000_000)
        t.copy_(source)
        if collective == "all_reduce":
            work = dist.all_reduce(t, async_op=True)
        elif collective == "all_gather_into_tensor":
            work = dist.all_gather_into_tensor(out, t, async_op=True)
        else:
            work = dist.broadcast(t, src=n - 1, async_op=True)
        if how == "wait":
            work.wait()
            doubled = out * 2  # queued on the side stream: must read the collective's result
        elif how == "future_wait":
            value = work.get_future().wait()
            if not isinstance(value, list):
                problems.append(f"get_future().wait() gave {type(value).__name__}, not a list of tensors")
            doubled = out * 2
        else:
            def double_output(future):
                future.value()  # raises the collective's error, if any
                return out * 2  # on the callback's current stream

            doubled = work.get_future().then(double_output).wait()
        got = doubled.cpu()  # a copy on the side stream: the host waits for that stream only
    problems += compare(got, _stream_expected(collective, n) * 2, None,
                        f"{collective}: what the current stream read after {how}")
    deadline = time.monotonic() + COMPLETION_DEADLINE_S
    while not work.is_completed():
        if time.monotonic() > deadline:
            problems.append(f"{collective}: work.is_completed() still False {COMPLETION_DEADLINE_S:g}s "
                            f"after {how}")
            break
        time.sleep(0.005)
    _synchronize(device)
    return problems


ALLOCATOR_COUNT = 1 << 22  # 16 MiB of float32: a block of its own in the caching allocator


def _case_caching_allocator(ctx):
    """A tensor deleted right after its async all_reduce is issued, while the current stream is
    still busy (a GPU sleep before the collective): new tensors of the same size, allocated and
    filled on the current stream, would get its block at once if the backend neither held the
    tensor nor recorded its use on the communication stream. Neither the result (read through
    work.result()) nor the new tensors may be corrupted. Then the same with the work dropped too
    (fire and forget), checked after a later collective."""
    device = _on_shared_gpu(ctx)
    n, rank = ctx.world_size, ctx.rank
    problems = []
    inputs = gen_all("cuda allocator", n, (ALLOCATOR_COUNT,), "float32")
    t = inputs[rank].to(device, copy=True)
    torch.cuda._sleep(50_000_000)
    work = dist.all_reduce(t, async_op=True)
    del t
    fresh = [torch.full((ALLOCATOR_COUNT,), float(100 + i), device=device) for i in range(4)]
    work.wait()
    result = work.result()
    if not (isinstance(result, list) and len(result) == 1):
        return [f"work.result() after wait() gave {result!r:.200}, not one tensor"]
    problems += check_reduction(result[0].cpu(), inputs, "SUM", "all_reduce of a deleted tensor, via work.result()")
    del work, result

    u = torch.full((ALLOCATOR_COUNT,), float(rank + 1), device=device)
    torch.cuda._sleep(50_000_000)
    dist.all_reduce(u, async_op=True)  # neither the work nor the tensor is kept
    del u
    fresh += [torch.full((ALLOCATOR_COUNT,), float(200 + i), device=device) for i in range(4)]
    after = torch.full((4099,), float(rank + 1), device=device)
    dist.all_reduce(after)  # issued after the dropped one, so done after it too
    torch.cuda.synchronize()
    expected = float(n * (n + 1) // 2)
    if not bool((after == expected).all().cpu()):
        problems.append(f"the all_reduce after the dropped one: {after[:4].cpu().tolist()}, expected {expected}")
    for i, tensor in enumerate(fresh):
        value = float(100 + i) if i < 4 else float(200 + i - 4)
        wrong = int((tensor != value).sum().cpu())
        if wrong:
            when = "kept" if i < 4 else "dropped"
            problems.append(f"new tensor #{i}, allocated after the tensor of an all_reduce whose work was "
                            f"{when} was deleted: {wrong} of {ALLOCATOR_COUNT} elements are not {value}")
    return problems


def _case_ddp_on_cuda(ctx):
    """DDP on the shared GPU trains to the one-process reference (tests/test_ddp.py's net), and
    every rank holds bitwise the same parameters."""
    import test_ddp
    from torch.nn.parallel import DistributedDataParallel
    device = _on_shared_gpu(ctx)
    # TF32 convolutions and matmuls would differ from the float32 CPU reference by ~1e-3.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = DistributedDataParallel(test_ddp._model().to(device),
                                    device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=test_ddp.LR, momentum=0.9)
    for step in range(test_ddp.STEPS):
        x, y = test_ddp._batch(ctx.rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device, copy=True)), y.to(device, copy=True)).backward()
        opt.step()
    problems = []
    mine = [p.detach().cpu() for p in model.module.parameters()]
    for i, (got, want) in enumerate(zip(mine, test_ddp._reference(ctx.world_size))):
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            problems.append(f"parameter {i} differs from the reference by "
                            f"{(got - want).abs().max().item():.3g}")
    # DDP keeps replicas identical: compared over a gloo group of CPU tensors (as test_ddp does).
    if "gloo_group" not in ctx.state:
        ctx.state["gloo_group"] = dist.new_group(backend="gloo")
    flat = torch.cat([p.reshape(-1) for p in mine])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat, group=ctx.state["gloo_group"])
    for r in range(ctx.world_size):
        if not torch.equal(gathered[r], gathered[0]):
            problems.append(f"the parameters on rank {r} differ from rank 0's "
                            f"(max |diff| {(gathered[r] - gathered[0]).abs().max().item():.3g})")
    return problems


def _case_callbacks_on_cuda(ctx, form):
    """A collective issued from a then() callback of a collective on CUDA tensors
    (tests/test_comm_hooks.py's forms)."""
    import test_comm_hooks
    return test_comm_hooks.collective_from_callback(ctx, form, _on_shared_gpu(ctx))


def _case_powersgd_on_cuda(ctx):
    """DDP with torch's PowerSGD hook on CUDA tensors, many buckets (its collectives issued from
    its futures' callbacks), against gloo on the same GPU running the hook one bucket at a time."""
    import test_comm_hooks
    import test_ddp
    device = _on_shared_gpu(ctx)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    if "gloo_group" not in ctx.state:
        ctx.state["gloo_group"] = dist.new_group(backend="gloo")
    gloo = ctx.state["gloo_group"]
    mine = test_comm_hooks.train_with_hook(ctx, None, "powerSGD", 0.001, False, None, device)
    theirs = test_comm_hooks.train_with_hook(ctx, gloo, "powerSGD", 0.001, True, "gloo", device)
    return (test_ddp._diff(mine, theirs, 1e-4, 1e-5, f"{ctx.backend} vs gloo (PowerSGD on {device})")
            + test_comm_hooks.compare_replicas(ctx, mine, gloo))


CUDA_TIMEOUT_S = 2.0  # the group's timeout


def _case_cuda_timeout(ctx):
    """The last rank never calls the second all_reduce on CUDA tensors; the others must raise
    DistBackendError at the group's timeout, naming the collective and the absent rank."""
    device = _on_shared_gpu(ctx)
    ctx.init_process_group(init="file", timeout=datetime.timedelta(seconds=CUDA_TIMEOUT_S))
    n, rank = ctx.world_size, ctx.rank
    absent = n - 1
    t = torch.ones(4099, device=device)
    dist.all_reduce(t)  # with everybody: the group and its CUDA path are set up
    _synchronize(device)
    if rank == absent:
        time.sleep(CUDA_TIMEOUT_S + 2.5)  # until the others have timed out (they started together)
        return []
    started = time.monotonic()
    try:
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        _synchronize(device)
    except Exception as error:  # noqa: BLE001 - what we are here to look at
        elapsed = time.monotonic() - started
        message = str(error)
        problems = []
        if not isinstance(error, dist.DistBackendError):
            problems.append(f"raised {type(error).__name__}, not DistBackendError: {message[:300]}")
        if not 0.8 * CUDA_TIMEOUT_S <= elapsed <= CUDA_TIMEOUT_S + 10:
            problems.append(f"raised after {elapsed:.2f}s; the group's timeout is {CUDA_TIMEOUT_S:g}s")
        if not re.search(r"all_?reduce", message, re.I):
            problems.append(f"the error does not name the collective: {message[:300]}")
        if not re.search(rf"\brank {absent}\b|\branks\b[^:.;]{{0,40}}\b{absent}\b", message, re.I):
            problems.append(f"the error does not name rank {absent}, which never came: {message[:300]}")
        return problems
    return [f"all_reduce on CUDA tensors without rank {absent} returned after "
            f"{time.monotonic() - started:.1f}s instead of raising"]


def _case_cuda_tensor_rejected(ctx):
    """all_reduce, broadcast, all_gather_into_tensor and send/recv on CUDA tensors: each raises
    on every rank (before anything moves) naming the call and saying this build has no CUDA path;
    the group then still works on CPU tensors."""
    device = _on_shared_gpu(ctx)
    n, rank = ctx.world_size, ctx.rank
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(4, device=device)),
        "broadcast": lambda: dist.broadcast(torch.ones(4, device=device), src=0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4 * n, device=device),
                                                                      torch.ones(4, device=device)),
    }
    if rank == 0:
        calls["send"] = lambda: dist.send(torch.ones(4, device=device), 1)
    elif rank == 1:
        calls["recv"] = lambda: dist.recv(torch.empty(4, device=device), 0)
    problems = []
    for name, call in calls.items():
        try:
            call()
        except Exception as e:  # noqa: BLE001
            text = str(e)
            if NO_CUDA_PATH not in text or name not in text:
                problems.append(f"{name} on a CUDA tensor raised, but not the clear error naming "
                                f"{name}'s tensor and saying {NO_CUDA_PATH!r}: {first_line(e)}")
        else:
            problems.append(f"{name} on a CUDA tensor returned instead of raising {NO_CUDA_PATH!r}")
    cpu = torch.ones(4)
    dist.all_reduce(cpu)
    if not bool((cpu == n).all()):
        problems.append(f"group broken after the rejections: {cpu.tolist()}")
    return problems
