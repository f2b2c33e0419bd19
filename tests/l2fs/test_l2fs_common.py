"""Pure helpers: path rules, size parsing, parallel CRC32C (must equal the plain checksum)."""

from __future__ import annotations

import os

import crc32c
import pytest

from l2fs.common import PathError, crc32c_fast, norm_path, parse_size


@pytest.mark.parametrize("n", [0, 1, 4 << 20, (8 << 20) - 1, 8 << 20, (8 << 20) + 1, 14_680_064, 3 * (4 << 20) + 7])
def test_crc32c_fast_matches(n: int) -> None:
    data = os.urandom(n)
    assert crc32c_fast(data) == crc32c.crc32c(data)
    assert crc32c_fast(memoryview(bytearray(data))) == crc32c.crc32c(data)


def test_crc32c_fast_detects_one_flipped_bit() -> None:
    data = bytearray(os.urandom(14_680_064))
    good = crc32c_fast(data)
    data[10_000_000] ^= 0x10
    assert crc32c_fast(data) != good


def test_norm_path() -> None:
    assert norm_path("/") == "/"
    assert norm_path("/a/b/") == "/a/b"
    for bad in ["", "a", "/a//b", "/a/../b", "/./a", "/a\x00", "/a\nb", "/" + "x" * 256, "/kv/\udcff"]:
        with pytest.raises(PathError):
            norm_path(bad)


def test_parse_size() -> None:
    assert parse_size("512M") == 512 << 20
    assert parse_size("10G") == 10 << 30
    assert parse_size("1.5g") == 3 << 29
    assert parse_size("4096") == 4096
    assert parse_size("2GiB") == 2 << 30
    with pytest.raises(ValueError):
        parse_size("ten gigs")
