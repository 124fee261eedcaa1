"""CUDA tensors (issues 8 and 15): nvcc builds the CUDA kernels for sm_80 and sm_90; the kernels
match CPU references for every dtype and op; every collective and send/recv on CUDA tensors with
2 and 4 ranks sharing one GPU (which NCCL refuses), against CPU references: odd sizes, a size
that crosses chunk boundaries, transposed views; NCCL's stream semantics (the collective waits
for the caller's stream, the result is visible to the current stream after wait(), get_future()
and its then() callbacks); the caching allocator (a tensor deleted while its collective runs);
DDP; a timeout that names the absent rank; and, for a build without the CUDA path on a machine
with a GPU, the clear error that names the tensor.

The collective cases run against torus when torch_torus._C.built_with_cuda (the extension was
built with its CUDA path), and against gloo as they are (TORUS_TEST_BACKENDS=gloo; gloo's gaps
on CUDA tensors are in expectations.py, keys "cuda.*"). Every test that cannot run says why:
no nvcc, torch without CUDA, no GPU, or torch_torus built without its CUDA path."""

from __future__ import annotations

import datetime
import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
import torch_torus
from reference import (DTYPE_NAMES, allreduce_contract, check_reduction, compare, dtype_of,
                       first_line, fmt_shape, gen, gen_all, redop, reduce_ref)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "reduce", "cuda", "*.cu")))
NVCC_ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]

# True exactly when torch_torus._C was built with its CUDA path (torch with CUDA and a CUDA
# toolkit at build time, TORUS_BUILD_CUDA not 0): then torus takes CUDA tensors in every
# collective and the cases below run against it as they run against gloo. Without it a CUDA
# tensor raises NO_CUDA_PATH (test_cuda_tensor_rejected_without_cuda_path).
TORUS_ACCEPTS_CUDA = bool(torch_torus._C.built_with_cuda)
NO_CUDA_PATH = "is a CUDA tensor, but this build of torch_torus has no CUDA path"
WITHOUT_CUDA_PATH = ("torch_torus was built without its CUDA path (torch_torus._C.built_with_cuda "
                     "is False: torch without CUDA, no CUDA toolkit, or TORUS_BUILD_CUDA=0)")


def gpu_missing() -> str | None:
    """Why no CUDA tensor can be made here, or None."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no GPU is visible to torch"
    return None


needs_gpu = pytest.mark.skipif(gpu_missing() is not None, reason=str(gpu_missing()))
needs_kernels = pytest.mark.skipif(not TORUS_ACCEPTS_CUDA, reason=WITHOUT_CUDA_PATH)


# ------------------------------------------------------------------------------ build


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_nvcc_builds_kernels_for_sm80_and_sm90():
    """Every .cu under csrc/reduce/cuda compiles for sm_80 and sm_90 with nothing but csrc on
    the include path: the kernels need no torch headers. The files compile in parallel."""
    assert CUDA_SOURCES, "no CUDA sources under csrc/reduce/cuda"
    with tempfile.TemporaryDirectory() as out:
        def compile_one(source):
            obj = os.path.join(out, os.path.basename(source) + ".o")
            cmd = ["nvcc", "-std=c++17", "-O3", *NVCC_ARCHS, "-I", os.path.join(ROOT, "csrc"),
                   "-c", source, "-o", obj]
            start = time.monotonic()
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            return source, cmd, done, time.monotonic() - start, obj

        with ThreadPoolExecutor(max_workers=len(CUDA_SOURCES)) as pool:
            results = list(pool.map(compile_one, CUDA_SOURCES))
        for source, cmd, done, seconds, obj in results:
            print(f"{os.path.relpath(source, ROOT)}: {seconds:.1f} s")
            assert done.returncode == 0, (f"{' '.join(cmd)} failed ({done.returncode}):\n"
                                          f"{done.stdout}{done.stderr}")
            assert os.path.getsize(obj) > 0, f"{obj} is empty"


# ------------------------------------------------------------------------------ kernels

KERNEL_OPS = ["sum", "product", "min", "max", "band", "bor", "bxor"]
# Enough sources for three launches (32 per launch, dst carried into the next).
SOURCE_COUNTS = [1, 2, 3, 70]
ELEMENT_COUNTS = [0, 1, 7, 4099]


def kernel_reference(sources, op: str):
    """What the kernel computes: a left fold over the sources, float16/bfloat16 in float and
    rounded once per launch of up to 32 sources, integers wrapping, bool as logic."""
    dt = sources[0].dtype
    if not dt.is_floating_point:
        return reduce_ref(sources, op.upper())
    fn = {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}[op]
    if dt not in (torch.float16, torch.bfloat16):
        return functools.reduce(fn, sources)
    acc = functools.reduce(fn, [s.float() for s in sources[:32]]).to(dt)
    for start in range(32, len(sources), 31):
        acc = functools.reduce(fn, [acc.float()] + [s.float() for s in sources[start:start + 31]]).to(dt)
    return acc


def kernel_inputs(dtype: str, op: str, n: int, count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dt = dtype_of(dtype)
    if dt == torch.bool:
        return [torch.randint(0, 2, (count,), generator=g).bool() for _ in range(n)]
    if dt.is_floating_point:
        # Products of many values stay finite near 1; MIN and MAX meet a NaN.
        xs = [(1 + 0.05 * torch.randn(count, generator=g, dtype=torch.float64)) if op == "product"
              else torch.randn(count, generator=g, dtype=torch.float64) for _ in range(n)]
        xs = [x.to(dt) for x in xs]
        if op in ("min", "max") and count >= 7:
            xs[-1][3] = float("nan")
        return xs
    info = torch.iinfo(dt)
    return [torch.randint(info.min, info.max, (count,), generator=g, dtype=torch.int64).to(dt)
            for _ in range(n)]


def on_device_at(tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """`tensor` copied to the GPU starting `offset` elements into a fresh allocation, so its
    address is 16-byte aligned (offset 0) or not."""
    storage = torch.empty(tensor.numel() + offset, dtype=tensor.dtype, device="cuda")
    view = storage[offset:]
    view.copy_(tensor)
    return view


@needs_gpu
@needs_kernels
@pytest.mark.parametrize("op", KERNEL_OPS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_reduce_sources_kernel(dtype, op):
    """reduceSourcesOnDevice for (dtype, op) against the CPU reference, over source and element
    counts, out of place and in place, with all pointers aligned alike (16-byte packs after a
    head) and with one source at another alignment (element-wise)."""
    dt = dtype_of(dtype)
    if dt.is_floating_point and op in ("band", "bor", "bxor"):
        with pytest.raises(ValueError, match=f"{op} of {dtype}"):
            torch_torus._C._reduce_sources_cuda(dtype, op, 0, [0], 1, 0)
        return
    stream = torch.cuda.current_stream()
    for n in SOURCE_COUNTS:
        for count in ELEMENT_COUNTS:
            for layout in ("aligned", "shared offset", "mixed offsets", "in place"):
                inputs = kernel_inputs(dtype, op, n, count, seed=n * 10007 + count)
                offsets = {"aligned": [0] * n, "shared offset": [1] * n,
                           "mixed offsets": [0] * (n - 1) + [1], "in place": [0] * n}[layout]
                sources = [on_device_at(x, o) for x, o in zip(inputs, offsets)]
                if layout == "in place":
                    dst = sources[0]
                else:
                    dst = on_device_at(torch.zeros_like(inputs[0]), offsets[0])
                torch_torus._C._reduce_sources_cuda(dtype, op, dst.data_ptr(),
                                                    [s.data_ptr() for s in sources], count,
                                                    stream.cuda_stream)
                label = f"{dtype} {op} sources={n} count={count} {layout}"
                torch.testing.assert_close(dst.cpu(), kernel_reference(inputs, op), rtol=0, atol=0,
                                           equal_nan=True, msg=lambda m: f"{label}: {m}")


@needs_gpu
@needs_kernels
@pytest.mark.parametrize("divide", [False, True], ids=["multiply", "divide"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_scale_kernel(dtype, divide):
    """scaleOnDevice equals torch's CPU mul_/div_ by a scalar, bit for bit (PREMUL_SUM, AVG)."""
    factor = 3.0 if divide else 1.0 / 3.0
    stream = torch.cuda.current_stream()
    for count in ELEMENT_COUNTS:
        for offset in (0, 1):
            g = torch.Generator().manual_seed(count)
            x = torch.randn(count, generator=g, dtype=torch.float64).to(dtype_of(dtype))
            buf = on_device_at(x, offset)
            torch_torus._C._scale_cuda(dtype, divide, buf.data_ptr(), count, factor,
                                       stream.cuda_stream)
            expected = x.clone().div_(factor) if divide else x.clone().mul_(factor)
            torch.testing.assert_close(buf.cpu(), expected, rtol=0, atol=0,
                                       msg=lambda m: f"{dtype} count={count} offset={offset}: {m}")


@needs_kernels
def test_kernels_reject_bad_input_by_name():
    """Errors name the dtype and op; they are raised before anything touches the GPU."""
    with pytest.raises(ValueError, match="bxor of float16 is not supported"):
        torch_torus._C._reduce_sources_cuda("float16", "bxor", 0, [0], 1, 0)
    with pytest.raises(ValueError, match="sum of int32 needs at least one source"):
        torch_torus._C._reduce_sources_cuda("int32", "sum", 0, [], 1, 0)
    with pytest.raises(ValueError, match="multiplication of int64 is not supported"):
        torch_torus._C._scale_cuda("int64", False, 0, 1, 2.0, 0)


# ------------------------------------------------------------------------------ collectives


def skip_unless_backend_takes_cuda(backend: str) -> None:
    reason = gpu_missing()
    if reason is not None:
        pytest.skip(reason)
    if harness.split_backend(backend)[0] == "torus" and not TORUS_ACCEPTS_CUDA:
        pytest.skip(f"{WITHOUT_CUDA_PATH}; test_cuda_tensor_rejected_without_cuda_path covers CUDA "
                    "tensors then")


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


@needs_gpu
@pytest.mark.parametrize("op", ["SUM", "AVG", "PREMUL_SUM", "PRODUCT", "MIN", "MAX", "BXOR"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_allreduce(backend, world_size, dtype, op):
    skip_unless_backend_takes_cuda(backend)
    if allreduce_contract(op, dtype) == "error":
        pytest.skip(f"{op} on {dtype} is rejected on every device (tests/test_allreduce.py)")
    harness.check(backend, world_size, _case_cuda_allreduce, dtype, op, timeout=120,
                  gap=expectations.gap(backend, "all_reduce", dtype, op, world_size))


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


@needs_gpu
@pytest.mark.parametrize("name,dtype", CUDA_COLLECTIVE_CASES,
                         ids=[f"{name}-{dtype}" for name, dtype in CUDA_COLLECTIVE_CASES])
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_collective(backend, world_size, name, dtype):
    skip_unless_backend_takes_cuda(backend)
    gap = expectations.gap(backend, f"cuda.{name}", dtype, world_size=world_size)
    if gap is not None and gap.skip:
        pytest.skip(str(gap))
    harness.check(backend, world_size, _case_cuda_collective, name, dtype, timeout=120, gap=gap)


# ------------------------------------------------------------------------------ sizes, layouts

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


@needs_gpu
@pytest.mark.parametrize("collective", ["all_reduce", "broadcast"])
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_sizes_and_transposed(backend, world_size, collective):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_cuda_sizes_and_transposed, collective, timeout=180,
                  gap=expectations.gap(backend, f"cuda.{collective}.sizes", "float32", world_size=world_size))


# ------------------------------------------------------------------------------ streams, futures


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


@needs_gpu
@pytest.mark.parametrize("how", STREAM_WAITS)
@pytest.mark.parametrize("collective", STREAM_COLLECTIVES)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_stream_semantics(backend, world_size, collective, how):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_stream_semantics, collective, how, timeout=120,
                  gap=expectations.gap(backend, f"cuda.stream.{collective}.{how}", world_size=world_size))


# ------------------------------------------------------------------------------ caching allocator


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


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_caching_allocator(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_caching_allocator, timeout=120,
                  gap=expectations.gap(backend, "cuda.caching_allocator", world_size=world_size))


# ------------------------------------------------------------------------------ DDP


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


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_ddp(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_ddp_on_cuda, timeout=180)


def _case_callbacks_on_cuda(ctx, form):
    """A collective issued from a then() callback of a collective on CUDA tensors
    (tests/test_comm_hooks.py's forms)."""
    import test_comm_hooks
    return test_comm_hooks.collective_from_callback(ctx, form, _on_shared_gpu(ctx))


@needs_gpu
@pytest.mark.parametrize("form", ["future_wait", "sync", "two_levels", "interleaved"])
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_collective_from_callback(backend, world_size, form):
    skip_unless_backend_takes_cuda(backend)
    if form == "interleaved" and not backend.startswith("torus"):
        pytest.skip("the order of a callback's collectives against the main thread's is torus's")
    harness.check(backend, world_size, _case_callbacks_on_cuda, form, timeout=120)


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


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_powersgd(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_powersgd_on_cuda, timeout=180)


# ------------------------------------------------------------------------------ timeout

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


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_timeout_names_absent_rank(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    results = harness.run_job(backend, world_size, _case_cuda_timeout, init="none", timeout=90)
    harness.conclude(harness.problems(results),
                     expectations.gap(backend, "cuda.timeout", world_size=world_size),
                     f"{backend} world_size={world_size} CUDA timeout")


# ------------------------------------------------------------------------------ without the CUDA path


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


@needs_gpu
def test_cuda_tensor_rejected_without_cuda_path(backend):
    """A build without the CUDA path (torch_torus._C.built_with_cuda False) on a machine with a
    GPU: a CUDA tensor gets an error naming the tensor and saying the build has no CUDA path,
    and the group stays usable."""
    if harness.split_backend(backend)[0] != "torus":
        pytest.skip("checks torus's own error for a build without its CUDA path")
    if TORUS_ACCEPTS_CUDA:
        pytest.skip("this build of torch_torus has its CUDA path (built_with_cuda is True): the "
                    "collective tests above take CUDA tensors")
    harness.check(backend, 2, _case_cuda_tensor_rejected)
