"""Pure helpers: path rules, size parsing, parallel CRC32C (must equal the plain checksum)."""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.mark.unit
def test_pwrite_all_writes_every_byte_in_pieces_and_lets_a_mapping_close(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-sized buffers go to files in writes of at most WRITE_PIECE (one 4+ MiB write into a new ext4 file ran
    ~9x slower on the test box), at the offset asked, and no view of the source outlives the call."""
    import mmap

    from l2fs.common import fileio

    sizes: list[int] = []
    real = os.pwrite
    monkeypatch.setattr(fileio.os, "pwrite", lambda fd, b, off: sizes.append(len(b)) or real(fd, b, off))
    data = os.urandom(3 * fileio.WRITE_PIECE + 12345)
    src = tmp_path / "src"
    src.write_bytes(data)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    try:
        with open(src, "rb") as f, mmap.mmap(f.fileno(), len(data), prot=mmap.PROT_READ) as mm:
            assert fileio.pwrite_all(dst, mm, 10) == len(data)
        assert os.pread(dst, len(data) + 20, 0) == b"\0" * 10 + data
        assert max(sizes) == fileio.WRITE_PIECE and sum(sizes) == len(data) and len(sizes) == 4
        assert fileio.pwrite_all(dst, b"") == 0
    finally:
        os.close(dst)
