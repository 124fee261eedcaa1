"""Sizes as the bench and the tuner take and print them: 4K, 64M (K = 1024, as nccl-tests)."""

from __future__ import annotations

import argparse
import re

SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)
SIZE_MULTIPLIERS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'4096', '4K', '64M', '1G', '1MiB' -> bytes (K = 1024, as nccl-tests)."""
    match = SIZE_PATTERN.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (expected e.g. 4096, 4K, 64M, 1G)")
    return int(match.group(1)) * SIZE_MULTIPLIERS[match.group(2).lower()]


def human_size(size: float) -> str:
    """4096 -> '4K', as the sizes are given on the command line."""
    for suffix in ("G", "M", "K"):
        if size >= SIZE_MULTIPLIERS[suffix.lower()]:
            return f"{size / SIZE_MULTIPLIERS[suffix.lower()]:g}{suffix}"
    return f"{size:g}"


def size_steps(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes: the -b, -e and -f of both tools."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes
