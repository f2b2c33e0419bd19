"""Large buffers and files: written in pieces, mapped populated.

Why: on the test box's ext4 (kernel 6.18) one write() of 4 MiB or more into a new file took ~9x as long as the
same bytes in 1 MiB writes (32 MiB: 76-79 ms against 7.7-8.8 ms; an O_TMPFILE was fast either way,
docs/results/2026-12-04-mount-fetch-splice.md). Every place that writes a block-sized buffer goes through here.
"""

from __future__ import annotations

import mmap
import os

WRITE_PIECE = 1 << 20  # bytes per write()
# mmap flags for reading a whole file at once: every page mapped in one call (a lazily faulted mapping takes a
# fault per 4 KiB page; l2fs.client.write.WriteOps.put_file has the numbers)
SHARED_POPULATED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def pwrite_all(fd: int, data: bytes | bytearray | memoryview | mmap.mmap, offset: int = 0) -> int:
    """Write all of `data` at `offset` in WRITE_PIECE writes; returns the bytes written (OSError on failure).
    Its views of `data` are released before it returns (a mapping can be closed right after)."""
    with memoryview(data) as base, base.cast("B") as mv:
        done = 0
        while done < mv.nbytes:
            with mv[done:done + WRITE_PIECE] as piece:
                done += os.pwrite(fd, piece, offset + done)
        return done
