"""CRC32C of large buffers in parallel pieces (KV chunks are checksummed on every read and write)."""

from __future__ import annotations

import os
import threading
from typing import Any

# ---------- parallel CRC32C ----------
# A 14.7 MB KV chunk takes ~1.5 ms to checksum on one core, as long as the read itself when the file is
# in the page cache. Large buffers are split into 4 MiB pieces checksummed on a small thread pool (the
# crc32c extension releases the GIL) and recombined with the GF(2) shift operator for 4 MiB of zeros.

_CRC_POLY = 0x82F63B78  # CRC32C, reflected
_CRC_PIECE_LOG2 = 22
_CRC_PIECE = 1 << _CRC_PIECE_LOG2
_crc_op: list[int] | None = None
_crc_pool = None
_crc_lock = threading.Lock()


def _gf2_times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _crc_setup() -> tuple[list[int], Any]:
    """Shift operator for one piece of zeros (computed once, ~3 ms) and the pool."""
    global _crc_op, _crc_pool
    with _crc_lock:
        if _crc_op is None:
            from concurrent.futures import ThreadPoolExecutor

            m = [_CRC_POLY] + [1 << n for n in range(31)]  # one zero bit
            for _ in range(3 + _CRC_PIECE_LOG2):
                m = [_gf2_times(m, m[n]) for n in range(32)]
            _crc_pool = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="l2fs-crc")
            _crc_op = m
        return _crc_op, _crc_pool


def crc32c_fast(buf: bytes | bytearray | memoryview) -> int:
    """CRC32C of buf, identical to crc32c.crc32c(buf); parallel for buffers of 8 MiB and more."""
    import crc32c

    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    if n < 2 * _CRC_PIECE or (os.cpu_count() or 1) < 2:
        return crc32c.crc32c(mv)
    op, pool = _crc_setup()
    first = n % _CRC_PIECE or _CRC_PIECE  # only the first piece may be short: one operator suffices
    pieces = [mv[:first]] + [mv[o:o + _CRC_PIECE] for o in range(first, n, _CRC_PIECE)]
    crcs = list(pool.map(lambda p: crc32c.crc32c(p, gil_release_mode=1), pieces))
    c = crcs[0]
    for x in crcs[1:]:
        c = _gf2_times(op, c) ^ x
    return c


def crc_pieces(n: int) -> list[tuple[int, int]]:
    """(start, end) of the pieces crc32c_fast/CrcPipeline use: only the first may be short."""
    if n < 2 * _CRC_PIECE:
        return [(0, n)]
    first = n % _CRC_PIECE or _CRC_PIECE
    return [(0, first)] + [(o, o + _CRC_PIECE) for o in range(first, n, _CRC_PIECE)]


def _crc_chain(piece: memoryview | list[memoryview]) -> int:
    import crc32c

    if not isinstance(piece, list):
        return crc32c.crc32c(piece, 0, 1)
    c = 0
    for part in piece:
        c = crc32c.crc32c(part, c, 1)
    return c


class Scatter:
    """Buffers laid end to end as one read destination, so a block lands in several places without a copy
    between them. Why: LMCache's chunk is its header followed by the KV; read into (a small header buffer, the
    L1 object's bytes), the KV needs no copy out of a staging buffer (23-39 ms per 268 MB, 2026-12-04)."""

    def __init__(self, parts: list[Any]) -> None:
        """parts: objects with the buffer protocol (bytearray, memoryview, a numpy array), written in order."""
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.parts)

    def views(self, start: int, end: int) -> list[memoryview]:
        """The pieces of the bytes [start, end) in each part they fall in, in order."""
        out, off = [], 0
        for p in self.parts:
            lo, hi = max(start, off), min(end, off + p.nbytes)
            if lo < hi:
                out.append(p[lo - off:hi - off])
            off += p.nbytes
            if off >= end:
                break
        return out


class CrcPipeline:
    """Checksum pieces (from crc_pieces) on the pool while the caller reads/receives the next one, so
    verification overlaps I/O instead of following it."""

    def __init__(self, pieces: int = 0) -> None:
        """pieces: how many add() calls will follow, when known. With one there is nothing to overlap: it is
        checksummed inline (GIL released), which saves a pool hop per small object (~0.15 ms per 1 MiB chunk)."""
        self._parts: list[Any] = []  # crc (inline) or a future of one
        self._inline = pieces == 1
        self._op, self._pool = _crc_setup()

    def add(self, piece: memoryview | list[memoryview]) -> None:
        """One piece: a buffer, or the buffers it lies in (a Scatter destination's views), in order."""
        if self._inline:
            self._parts.append(_crc_chain(piece))
        else:
            self._parts.append(self._pool.submit(_crc_chain, piece))

    def result(self) -> int:
        crcs = [p if isinstance(p, int) else p.result() for p in self._parts]
        if not crcs:
            return 0
        c = crcs[0]
        for x in crcs[1:]:
            c = _gf2_times(self._op, c) ^ x
        return c
