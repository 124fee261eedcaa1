"""Sizes, rates and durations as people write them, read in one unit convention.

    sizes      -> bytes (int). K, M and G are binary (1K = 1024, as nccl-tests and our
                  TORUS_CHUNK_BYTES), optionally followed by B or iB:
                  524288, 512K, 64KiB, 1M, 2g
    rates      -> bytes per second (float). Prefixes k, M, G, T are decimal, as links are quoted.
                  Written in bits, as tc and NICs name rates: 10gbit, 1Gbit/s, 300mbit, 25gbitps;
                  or in bytes: 12.5GB/s, 117MB/s (a capital B: 'Gb' is too often meant as bits).
                  A number without a unit is refused unless the caller names the unit it means.
    durations  -> seconds (float): 20us, 1.5ms, 2s, 500ns; 0 needs no unit.

Numbers are ASCII digits (digits from other scripts are refused, not read), sizes whole, rates
and durations with an optional decimal point; no signs, no exponents. Units are
case-insensitive except the B of bytes per second; whitespace around the value is ignored.

A value refused raises ValueError saying what was expected. `argument(parse)` makes any of the
parsers an argparse type whose error also shows the value.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal
from typing import Callable, TypeVar

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_SIZE = re.compile(r"(\d+)\s*([KMG]?)(?:i?B)?", re.IGNORECASE | re.ASCII)
_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_RATE = re.compile(_NUMBER + r"\s*((?i:[kmgt])?)((?i:bit(?:/s|ps)?)|B/s)?", re.ASCII)
_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_DURATION = re.compile(_NUMBER + r"\s*(s|ms|us|ns)?", re.IGNORECASE | re.ASCII)
_PER_SECOND = {"s": 1, "ms": 1e3, "us": 1e6, "ns": 1e9}


def parse_size(text: str, limit: int | None = None) -> int:
    """'524288', '512K', '1M', '64KiB' -> bytes (at most `limit`, when given)."""
    match = _SIZE.fullmatch(str(text).strip())
    if not match:
        raise ValueError("expected a byte count such as 524288, 512K or 1M")
    value = int(match.group(1)) * _BINARY[match.group(2).upper()]
    if limit is not None and value > limit:
        raise ValueError(f"{value} bytes is more than the largest allowed, {limit}")
    return value


def parse_rate(text: str, default_unit: str | None = None) -> float:
    """'10gbit', '1Gbit/s', '300mbit' (bits), '12.5GB/s' (bytes) -> bytes per second.
    `default_unit` ('bit/s' or 'B/s') is the unit of a number written without one ('117M')."""
    match = _RATE.fullmatch(str(text).strip())
    unit = (match.group(3) if match else None) or default_unit
    if not match or unit is None:
        bare = f"; a number alone is in {default_unit}" if default_unit else ""
        raise ValueError("expected a rate such as 10gbit, 100mbit or 1.5gbit (bits per second) "
                         f"or 1.25GB/s (bytes per second){bare}")
    value = float(match.group(1)) * _DECIMAL[match.group(2).lower()]
    value = value if unit == "B/s" else value / 8
    if value <= 0:
        raise ValueError("must be greater than zero")
    return value


def render_bit_rate(bytes_per_second: float) -> str:
    """Text that parse_rate reads back as `bytes_per_second`, in bits."""
    return f"{format(Decimal(repr(bytes_per_second * 8)), 'f')}bit"


def parse_duration(text: str, default_unit: str | None = None) -> float:
    """'20us', '1.5ms', '0' -> seconds. `default_unit` ('s', 'ms', ...) is the unit of a number
    written without one; without it only 0 may omit its unit."""
    match = _DURATION.fullmatch(str(text).strip())
    unit = (match.group(2) if match else None) or default_unit
    if not match or (unit is None and float(match.group(1)) != 0):
        raise ValueError("expected a duration such as 20us, 1.5ms or 0 (units s, ms, us, ns)")
    return float(match.group(1)) / _PER_SECOND[(unit or "s").lower()]


def render_duration(seconds: float) -> str:
    """Text that parse_duration reads back as `seconds`."""
    return f"{format(Decimal(repr(seconds)), 'f')}s"


T = TypeVar("T")


def argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse type: a refused value's error shows the value and what was expected."""
    def parse_argument(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None

    parse_argument.__name__ = getattr(parse, "__name__", "value")
    return parse_argument
