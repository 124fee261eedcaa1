"""The emulated hosts' links: rates in tc's syntax, and the token bucket (tbf) that shapes them."""

from __future__ import annotations

import argparse
import re

RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
              "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def parse_rate(text: str) -> float | None:
    """tc's rate syntax ('1gbit', '500mbit', '125mbps' = bytes) -> bits per second; 'none' or
    '0' -> None (links not shaped)."""
    text = text.strip().lower()
    if text in ("none", "0", ""):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text)
    if not match or match.group(2) not in RATE_UNITS:
        raise argparse.ArgumentTypeError(
            f"not a rate: {text!r} (e.g. 1gbit, 500mbit, 100mbps; units {', '.join(RATE_UNITS)})")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def default_burst(rate_bits: float) -> int:
    """tbf's bucket in bytes: 1 ms worth of the rate, at least 128 KiB. The bucket must hold the
    largest packet the veth hands down (GSO packets up to 64 KiB); a bucket much smaller than
    the rate times the kernel's timer granularity leaves the link below its rate."""
    return max(128 << 10, int(rate_bits / 8 / 1000))


def format_rate(rate_bits: float | None) -> str:
    if rate_bits is None:
        return "unshaped"
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bits >= factor:
            return f"{rate_bits / factor:g}{unit}"
    return f"{rate_bits:g}bit"
