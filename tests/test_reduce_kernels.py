"""The reduction kernels, every instruction-set variant of each (portable, AVX2, AVX-512), against
torch computed in this process: CI's machine may lack AVX-512 or AVX2 and then runs the narrower
kernels, which a machine with them only reaches when a test names them (torus_testing's
reduce_into). Also: the dispatch hands the collectives the widest variant the CPU runs, and a
variant the CPU cannot run is refused rather than executed."""

from __future__ import annotations

import pytest
import torch

import torus_testing

ISAS = ["portable", "avx2", "avx512"]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
OPS = ["sum", "product", "min", "max", "band", "bor", "bxor"]
# Empty, shorter than one vector, one 64-byte vector and a tail, many vectors and a tail.
LENGTHS = [0, 1, 7, 64 + 5, 4099]


@pytest.fixture(scope="module")
def kernels():
    return torus_testing.module()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _runs(kernels, isa: str) -> bool:
    return ISAS.index(isa) <= ISAS.index(kernels.best_isa())


def _supported(dtype: torch.dtype, op: str) -> bool:
    return not (dtype.is_floating_point and op in ("band", "bor", "bxor"))


def _reference(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    if a.dtype == torch.bool:  # a byte of 0 or 1: sum and max are or, product and min are and
        op = {"sum": "bor", "max": "bor", "product": "band", "min": "band"}.get(op, op)
    return {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum,
            "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op](a, b)


def _data(dtype: torch.dtype, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (length,), generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(length, generator=generator, dtype=torch.float64) * 4).to(dtype)
    info = torch.iinfo(dtype)  # the whole range: sums and products wrap, as torch's do
    return torch.randint(info.min, info.max, (length,), generator=generator, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool], ids=_name)
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_matches_torch(isa, dtype, op, kernels):
    for length in LENGTHS:
        # One element more, so that [1:] gives the kernel operands that are not vector-aligned.
        a, b = _data(dtype, length + 1, seed=length), _data(dtype, length + 1, seed=length + 1000)
        for offset in (0, 1):
            dst, src = a.clone()[offset:offset + length], b.clone()[offset:offset + length]
            before = dst.clone()
            ran = kernels.reduce_into(dst, src, op, isa)
            if not (_supported(dtype, op) and _runs(kernels, isa)):
                assert not ran, f"{isa} {op} on {dtype} ran where it cannot"
                assert torch.equal(dst, before)
                continue
            assert ran
            expected = _reference(before, src, op)
            assert torch.equal(dst, expected), (
                f"{isa} {op} on {dtype}, {length} elements at offset {offset}: "
                f"{(dst != expected).sum().item()} differ, first at {(dst != expected).nonzero()[0].item()}")


SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 1e-40, -3.0e38, 65504.0, 7.0e-6]


@pytest.mark.parametrize("op", ["sum", "product", "min", "max"])
@pytest.mark.parametrize("dtype", FLOATS, ids=_name)
def test_special_values_agree_across_isas(dtype, op, kernels):
    """NaN, infinities, signed zeros, subnormals and the largest values: every variant gives the
    portable kernel's bits, and NaN wherever torch gives NaN."""
    # Every pair of specials, repeated past a vector's width so each lane and the tail see them.
    pairs = [(x, y) for x in SPECIALS for y in SPECIALS]
    a = torch.tensor([x for x, _ in pairs] * 3, dtype=torch.float64).to(dtype)
    b = torch.tensor([y for _, y in pairs] * 3, dtype=torch.float64).to(dtype)
    results = {}
    for isa in ISAS:
        if _runs(kernels, isa):
            dst = a.clone()
            assert kernels.reduce_into(dst, b, op, isa)
            results[isa] = dst
    portable = results["portable"]
    for isa, result in results.items():
        assert torch.equal(_bits(result), _bits(portable)), f"{isa} differs from portable for {op} on {dtype}"
    expected = _reference(a, b, op)
    assert torch.equal(portable.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(portable[finite], expected[finite])


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def test_dispatch_picks_the_widest_the_cpu_runs(kernels):
    """best_isa follows the CPU's flags, and every kernel the collectives get is built for it."""
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if not flags:
        pytest.skip("/proc/cpuinfo names no CPU flags here (not x86-64)")
    expected = ("avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if {"avx2", "f16c"} <= flags
                else "portable")
    assert kernels.best_isa() == expected
    assert kernels.isas() == ISAS
    for dtype in FLOATS + INTS + [torch.bool]:
        for op in OPS:
            chosen = kernels.dispatched_isa(_name(dtype), op)
            assert chosen == (expected if _supported(dtype, op) else None), (dtype, op)


@pytest.mark.parametrize("nbytes,offset", [(0, 0), (1, 0), (4095, 0), (16 << 10, 0), ((64 << 10) + 17, 0),
                                           ((1 << 20) + 64, 8), ((1 << 20) + 64, 16)])
def test_streaming_copy_copies_every_byte(nbytes, offset):
    """The bench's memory bound copies with non-temporal stores: the four-page interleaved bulk,
    the tail, and unaligned buffers (a plain copy) each land every byte where it belongs."""
    from torch_torus import _C

    source = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8)[offset:]
    target = torch.zeros(nbytes + offset, dtype=torch.uint8)[offset:]
    _C.streaming_copy(target, source)
    assert torch.equal(target, source)


def test_streaming_copy_refuses_buffers_of_different_sizes():
    from torch_torus import _C

    with pytest.raises(ValueError, match="target has 5 bytes, source 8"):
        _C.streaming_copy(torch.empty(5, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8))
