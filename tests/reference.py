"""Deterministic inputs, single-process references and per-dtype tolerances.

Every rank can compute every rank's input (``gen(key, rank, ...)`` depends only on the key,
the rank, the shape and the dtype), so each rank computes the reference locally and returns
a list of problem strings ([] = pass) that names the case precisely.
"""

from __future__ import annotations

import functools
import zlib
from typing import List, Sequence

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = list(DTYPES)
FLOAT_DTYPES = ["float32", "float64", "float16", "bfloat16"]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8"]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
BITWISE = {"BAND", "BOR", "BXOR"}
#: what torch's distributed tests (distributed_test.py's barrier timeouts) and tools that follow
#: them look for in the error of a timeout or of a peer's closed connection
TORCH_ERROR_WORDS = r" (Timed out|closed|timeout) "
#: the scale factor used for PREMUL_SUM (inexact in binary on purpose)
PREMUL_FACTOR = 1.0 / 3.0
WORLD_SIZES = [1, 2, 3, 4, 8]


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


def is_float(name: str) -> bool:
    return name in FLOAT_DTYPES


# ------------------------------------------------------------------------------ contract


def allreduce_contract(op: str, dtype: str) -> str:
    """What every backend must do for a reduction (op, dtype): "ok" or "error".

    - bitwise ops (BAND/BOR/BXOR) are defined for integers and bool only;
    - AVG and PREMUL_SUM need a division/scaling: floating dtypes only;
    the error must name the op (e.g. "BAND"), on every rank.
    """
    if op in BITWISE and is_float(dtype):
        return "error"
    if op in ("AVG", "PREMUL_SUM") and not is_float(dtype):
        return "error"
    return "ok"


def redop(op: str, factor: float = PREMUL_FACTOR):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, op)


# ------------------------------------------------------------------------------ inputs


def _generator(key, rank) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{key}|{rank}".encode()))


def gen(key, rank: int, shape, dtype: str, op: str = "SUM") -> torch.Tensor:
    """Rank ``rank``'s input for case ``key``; small values so that integer sums/products
    of up to 8 ranks do not overflow (except where a test wants wrap-around on purpose)."""
    g = _generator(key, rank)
    shape = tuple(shape)
    dt = DTYPES[dtype]
    if dtype == "bool":
        return torch.rand(shape, generator=g) < 0.5
    if is_float(dtype):
        u = torch.rand(shape, generator=g, dtype=torch.float64)
        if op == "PRODUCT":  # magnitudes in [0.5, 1.5], random signs
            sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
            x = (0.5 + u) * sign
        else:
            x = u * 2 - 1
        return x.to(dt)
    info = torch.iinfo(dt)
    if op in BITWISE:
        lo, hi = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)
        return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(dt)
    if op == "PRODUCT":  # mostly +-1, some +-2 and 0
        k = torch.randint(0, 16, shape, generator=g)
        v = torch.where(k < 7, 1, torch.where(k < 14, -1, torch.where(k == 14, 2, 0)))
        if info.min == 0:
            v = v.abs()
        return v.to(dt)
    bound = {"int8": 10, "uint8": 30, "int16": 1000, "int32": 10 ** 6, "int64": 10 ** 12}[dtype]
    lo = 0 if info.min == 0 else -bound
    return torch.randint(lo, bound + 1, shape, generator=g, dtype=torch.int64).to(dt)


def gen_all(key, world_size: int, shape, dtype: str, op: str = "SUM") -> List[torch.Tensor]:
    return [gen(key, r, shape, dtype, op) for r in range(world_size)]


# ------------------------------------------------------------------------------ references


def reduce_ref(inputs: Sequence[torch.Tensor], op: str, factor: float = PREMUL_FACTOR):
    """Reference of reducing ``inputs`` (one per rank) with ``op``.

    Floats: computed in float64 (returned in float64).  Integers: computed in the dtype
    itself, so SUM/PRODUCT wrap around exactly like torch.  Bool: logical semantics
    (SUM/MAX/BOR = any, PRODUCT/MIN/BAND = all, BXOR = parity)."""
    dt = inputs[0].dtype
    n = len(inputs)
    if dt == torch.bool:
        stack = torch.stack([x.to(torch.int64) for x in inputs])
        if op in ("SUM", "MAX", "BOR"):
            return stack.sum(0) > 0
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.sum(0) == n
        if op == "BXOR":
            return stack.sum(0) % 2 == 1
        raise ValueError(op)
    if dt.is_floating_point:
        xs = [x.to(torch.float64) for x in inputs]
        if op == "SUM":
            return functools.reduce(torch.add, xs)
        if op == "AVG":
            return functools.reduce(torch.add, xs) / n
        if op == "PREMUL_SUM":
            return functools.reduce(torch.add, [x * factor for x in xs])
        if op == "PRODUCT":
            return functools.reduce(torch.mul, xs)
        if op == "MIN":
            return functools.reduce(torch.minimum, xs)
        if op == "MAX":
            return functools.reduce(torch.maximum, xs)
        raise ValueError(op)
    fn = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
          "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    return functools.reduce(lambda a, b: fn(a, b).to(dt), inputs)


def eps(dt: torch.dtype) -> float:
    return torch.finfo(dt).eps


def tolerance(inputs: Sequence[torch.Tensor], op: str, ref: torch.Tensor,
              factor: float = PREMUL_FACTOR):
    """Per-element absolute tolerance for a float reduction, or None for exact.

    Rounding of a sum of n terms in any order is bounded by (n-1)*eps*sum|x_i|, plus the final
    rounding eps*|ref|; products by n*eps*|ref|.  We allow twice that."""
    dt = inputs[0].dtype
    if not dt.is_floating_point or op in ("MIN", "MAX"):
        return None
    n = len(inputs)
    e = eps(dt)
    tiny = torch.finfo(dt).tiny * n
    absref = ref.abs()
    if op == "PRODUCT":
        return 2 * e * (n + 1) * absref + tiny
    mag = functools.reduce(torch.add, [x.to(torch.float64).abs() for x in inputs])
    if op == "AVG":
        mag = mag / n
    elif op == "PREMUL_SUM":
        mag = mag * abs(factor)
    return 2 * e * (absref + n * mag) + tiny


def compare(out: torch.Tensor, ref: torch.Tensor, tol=None, label: str = "") -> List[str]:
    """[] if ``out`` matches ``ref`` (exactly, or within the per-element ``tol``)."""
    where = f"{label}: " if label else ""
    if tuple(out.shape) != tuple(ref.shape):
        return [f"{where}shape {tuple(out.shape)} != expected {tuple(ref.shape)}"]
    if out.numel() == 0:
        return []
    if tol is None:
        if out.dtype != ref.dtype:
            ref = ref.to(out.dtype)
        bad = out != ref
    else:
        diff = (out.to(torch.float64) - ref.to(torch.float64)).abs()
        bad = ~(diff <= tol)  # NaN counts as bad
    nbad = int(bad.sum())
    if nbad == 0:
        return []
    flat_bad = bad.reshape(-1).nonzero()[:, 0]
    i = int(flat_bad[0])
    o = out.reshape(-1)[i].item()
    r = ref.reshape(-1)[i].item()
    msg = (f"{where}{nbad}/{out.numel()} elements wrong; first at flat index {i}: "
           f"got {o!r}, expected {r!r}")
    if tol is not None:
        t = tol.reshape(-1)[i].item() if isinstance(tol, torch.Tensor) else tol
        msg += f" (tolerance {t:.3g})"
    if nbad > 1:
        msg += f"; wrong indices start {flat_bad[:8].tolist()}"
    return [msg]


def check_reduction(out: torch.Tensor, inputs: Sequence[torch.Tensor], op: str,
                    label: str, factor: float = PREMUL_FACTOR) -> List[str]:
    ref = reduce_ref(inputs, op, factor)
    return compare(out, ref, tolerance(inputs, op, ref, factor), label)


def error_names_op(exc: BaseException, op: str) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return op.lower() in text or op.lower().replace("_", "") in text.replace("_", "")


def first_line(exc: BaseException) -> str:
    s = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {s[0] if s else ''}"[:300]


def shapes_for(world_size: int) -> List[tuple]:
    """Element counts every reduction is checked with: empty, scalar, 1, 7, odd, not
    divisible by the world size, several dims, a few thousand."""
    n = world_size
    return [(0,), (), (1,), (7,), (33,), (13 * n + 1,), (n + 1, 3), (3, 0, 2), (2, 3, 5), (4099,)]


def fmt_shape(shape) -> str:
    return "x".join(map(str, shape)) if len(shape) else "scalar"
