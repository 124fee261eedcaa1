"""The group's secret: the HMAC-SHA256 that every hello proves it with, checked against Python's
hmac module (the RFC 4231 vectors, and lengths around SHA-256's block edges)."""

from __future__ import annotations

import hashlib
import hmac

import pytest

import torus_testing


@pytest.fixture(scope="module")
def hmac_sha256():
    return torus_testing.module().hmac_sha256

# RFC 4231, test cases 1-7: (key, data).
RFC_4231 = [
    (b"\x0b" * 20, b"Hi There"),
    (b"Jefe", b"what do ya want for nothing?"),
    (b"\xaa" * 20, b"\xdd" * 50),
    (bytes(range(1, 26)), b"\xcd" * 50),
    (b"\x0c" * 20, b"Test With Truncation"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First"),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than block-size data. The key "
                    b"needs to be hashed before being used by the HMAC algorithm."),
]


@pytest.mark.parametrize("case", range(len(RFC_4231)))
def test_hmac_matches_rfc_4231(case, hmac_sha256):
    key, data = RFC_4231[case]
    assert hmac_sha256(key, data) == hmac.new(key, data, hashlib.sha256).digest()


@pytest.mark.parametrize("length", [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 1000])
def test_hmac_at_block_edges(length, hmac_sha256):
    key = bytes(range(32))
    data = bytes((7 * i) % 256 for i in range(length))
    assert hmac_sha256(key, data) == hmac.new(key, data, hashlib.sha256).digest()
    assert hmac_sha256(data, key) == hmac.new(data, key, hashlib.sha256).digest()
