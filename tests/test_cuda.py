"""CUDA tensors (issue 8): nvcc builds the CUDA kernels for sm_80 and sm_90; the kernels match
CPU references for every dtype and op; collectives on CUDA tensors with 2 and 4 ranks sharing
one GPU, their stream semantics and DDP; and, until torus accepts CUDA tensors, its clear
"not supported yet" error.

Every test that cannot run says why: no nvcc, torch without CUDA, no GPU, torch_torus built
without its CUDA kernels, or torus not accepting CUDA tensors yet."""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import expectations
import harness
import torch_torus
from reference import (DTYPE_NAMES, allreduce_contract, check_reduction, dtype_of, first_line,
                       gen_all, redop, reduce_ref)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "reduce", "cuda", "*.cu")))
NVCC_ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]

# ProcessGroupTorus rejects CUDA tensors with "not supported yet" until its CUDA path (README,
# "CUDA tensors: status") is built; set this then, and the collective cases below run against
# torus as they already do against gloo (TORUS_TEST_BACKENDS=gloo).
TORUS_ACCEPTS_CUDA = False


def gpu_missing() -> str | None:
    """Why no CUDA tensor can be made here, or None."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no GPU is visible to torch"
    return None


needs_gpu = pytest.mark.skipif(gpu_missing() is not None, reason=str(gpu_missing()))
needs_kernels = pytest.mark.skipif(
    not torch_torus._C.built_with_cuda,
    reason="torch_torus was built without its CUDA kernels (torch without CUDA, no CUDA toolkit, "
           "or TORUS_BUILD_CUDA=0)")


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
        pytest.skip("torus does not accept CUDA tensors yet: its CUDA path is designed (README, "
                    "'CUDA tensors: status') but not built; test_cuda_tensor_rejected covers it")


def _on_shared_gpu(ctx) -> torch.device:
    """Every rank on GPU 0: several ranks sharing one device, which NCCL refuses."""
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _case_cuda_allreduce(ctx, dtype, op):
    device = _on_shared_gpu(ctx)
    problems = []
    for count in (0, 1, 7, 4099, 1 << 20):
        inputs = gen_all(("cuda allreduce", dtype, op, count), ctx.world_size, (count,), dtype, op)
        t = inputs[ctx.rank].to(device)
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


def _case_cuda_collectives(ctx):
    """broadcast, all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single on CUDA
    tensors against CPU references."""
    device = _on_shared_gpu(ctx)
    n, rank = ctx.world_size, ctx.rank
    problems = []
    values = [torch.arange(n * 5, dtype=torch.float32) + 100 * r for r in range(n)]

    t = values[rank].to(device)
    dist.broadcast(t, src=n - 1)
    if not torch.equal(t.cpu(), values[n - 1]):
        problems.append(f"broadcast: {t.cpu().tolist()}")

    out = torch.empty(n * 5 * n, device=device)
    dist.all_gather_into_tensor(out, values[rank].to(device))
    if not torch.equal(out.cpu(), torch.cat(values)):
        problems.append("all_gather_into_tensor differs from the concatenation of every rank's input")

    out = torch.empty(5, device=device)
    dist.reduce_scatter_tensor(out, values[rank].to(device))
    if not torch.equal(out.cpu(), sum(values).view(n, 5)[rank]):
        problems.append(f"reduce_scatter_tensor: {out.cpu().tolist()}")

    out = torch.empty(n * 5, device=device)
    dist.all_to_all_single(out, values[rank].to(device))
    expected = torch.cat([values[r].view(n, 5)[rank] for r in range(n)])
    if not torch.equal(out.cpu(), expected):
        problems.append(f"all_to_all_single: {out.cpu().tolist()}")
    return problems


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_collectives(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_cuda_collectives, timeout=120)


def _case_stream_semantics(ctx):
    """On a side stream: the input is written by a copy queued behind a ~0.1 s GPU sleep, so
    the collective must wait for the stream's pending writes; after wait() (and after the
    future completes) the current stream sees the result without any host synchronization."""
    device = _on_shared_gpu(ctx)
    n = ctx.world_size
    problems = []
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for use_future in (False, True):
            source = torch.full((1 << 20,), float(ctx.rank + 1), device=device)
            t = torch.zeros_like(source)
            torch.cuda._sleep(100_000_000)
            t.copy_(source)
            work = dist.all_reduce(t, async_op=True)
            if use_future:
                result = work.get_future().wait()[0]
            else:
                work.wait()
                result = t
            doubled = result * 2  # queued on the side stream: must read the reduced values
            expected = float(n * (n + 1))
            if not bool((doubled == expected).all().cpu()):
                how = "get_future().wait()" if use_future else "wait()"
                problems.append(f"after {how} the current stream read {doubled[:4].cpu().tolist()}, "
                                f"expected {expected}")
    return problems


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_stream_semantics(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_stream_semantics, timeout=120)


def _case_ddp_on_cuda(ctx):
    """DDP on the shared GPU trains to the one-process reference (tests/test_ddp.py's net)."""
    import test_ddp
    from torch.nn.parallel import DistributedDataParallel
    device = _on_shared_gpu(ctx)
    # TF32 convolutions and matmuls would differ from the float32 CPU reference by ~1e-3.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = DistributedDataParallel(test_ddp._model().to(device), device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=test_ddp.LR, momentum=0.9)
    for step in range(test_ddp.STEPS):
        x, y = test_ddp._batch(ctx.rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    problems = []
    for i, (got, want) in enumerate(zip(model.module.parameters(), test_ddp._reference(ctx.world_size))):
        if not torch.allclose(got.detach().cpu(), want, rtol=1e-4, atol=1e-5):
            problems.append(f"parameter {i} differs from the reference by "
                            f"{(got.detach().cpu() - want).abs().max().item():.3g}")
    return problems


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_ddp(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_ddp_on_cuda, timeout=180)


# ------------------------------------------------------------------------------ until then


def _case_cuda_tensor_rejected(ctx):
    _on_shared_gpu(ctx)
    t = torch.ones(4, device="cuda")
    try:
        dist.all_reduce(t)
    except Exception as e:
        text = str(e)
        if "all_reduce tensor is a CUDA tensor; CUDA tensors are not supported yet" not in text:
            return [f"all_reduce on a CUDA tensor raised, but not the clear error: {first_line(e)}"]
    else:
        return ["all_reduce on a CUDA tensor returned instead of raising 'not supported yet'"]
    cpu = torch.ones(4)
    dist.all_reduce(cpu)
    if not bool((cpu == ctx.world_size).all()):
        return [f"group broken after the rejection: {cpu.tolist()}"]
    return []


@needs_gpu
@pytest.mark.skipif(TORUS_ACCEPTS_CUDA, reason="torus accepts CUDA tensors")
def test_cuda_tensor_rejected():
    """Until torus has its CUDA path, a CUDA tensor gets an error naming the tensor and saying
    'not supported yet' (with the device-map workaround), and the group stays usable."""
    harness.check("torus", 2, _case_cuda_tensor_rejected)
