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

import expectations
import harness
import torch_torus
from cuda_cases import (CUDA_COLLECTIVE_CASES, STREAM_COLLECTIVES, STREAM_WAITS, TORUS_ACCEPTS_CUDA,
                        WITHOUT_CUDA_PATH, _case_caching_allocator, _case_callbacks_on_cuda,
                        _case_cuda_allreduce, _case_cuda_collective, _case_cuda_sizes_and_transposed,
                        _case_cuda_tensor_rejected, _case_cuda_timeout, _case_ddp_on_cuda,
                        _case_powersgd_on_cuda, _case_stream_semantics)
from reference import DTYPE_NAMES, allreduce_contract, dtype_of, reduce_ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "reduce", "cuda", "*.cu")))
NVCC_ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]


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


@needs_gpu
@pytest.mark.parametrize("collective", ["all_reduce", "broadcast"])
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_sizes_and_transposed(backend, world_size, collective):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_cuda_sizes_and_transposed, collective, timeout=180,
                  gap=expectations.gap(backend, f"cuda.{collective}.sizes", "float32", world_size=world_size))


# ------------------------------------------------------------------------------ streams, futures


@needs_gpu
@pytest.mark.parametrize("how", STREAM_WAITS)
@pytest.mark.parametrize("collective", STREAM_COLLECTIVES)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_stream_semantics(backend, world_size, collective, how):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_stream_semantics, collective, how, timeout=120,
                  gap=expectations.gap(backend, f"cuda.stream.{collective}.{how}", world_size=world_size))


# ------------------------------------------------------------------------------ caching allocator


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_caching_allocator(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_caching_allocator, timeout=120,
                  gap=expectations.gap(backend, "cuda.caching_allocator", world_size=world_size))


# ------------------------------------------------------------------------------ DDP


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_ddp(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_ddp_on_cuda, timeout=180)


@needs_gpu
@pytest.mark.parametrize("form", ["future_wait", "sync", "two_levels", "interleaved"])
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_collective_from_callback(backend, world_size, form):
    skip_unless_backend_takes_cuda(backend)
    if form == "interleaved" and not backend.startswith("torus"):
        pytest.skip("the order of a callback's collectives against the main thread's is torus's")
    harness.check(backend, world_size, _case_callbacks_on_cuda, form, timeout=120)


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_powersgd(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    harness.check(backend, world_size, _case_powersgd_on_cuda, timeout=180)


# ------------------------------------------------------------------------------ timeout


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"ws{w}")
def test_cuda_timeout_names_absent_rank(backend, world_size):
    skip_unless_backend_takes_cuda(backend)
    results = harness.run_job(backend, world_size, _case_cuda_timeout, init="none", timeout=90)
    harness.conclude(harness.problems(results),
                     expectations.gap(backend, "cuda.timeout", world_size=world_size),
                     f"{backend} world_size={world_size} CUDA timeout")


# ------------------------------------------------------------------------------ without the CUDA path


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
