"""A compromised worker for the trust tests: a real `l2fs worker` process whose store alters what it keeps.

Run as `python reliability_evil_worker.py MODE <l2fs worker args>`. Every block it takes (over the data plane or
gRPC, and every same-node adoption) is stored with its first byte flipped. MODE says what it answers:
`own-crc` the CRC32C of the altered bytes (what it stored: a worker that covers its tracks), `writer-crc` the
CRC32C the writer's bytes had (a worker that lies about what it kept). Nothing else of the worker changes: it
registers, takes capabilities, serves reads and reports its blocks as the real one does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import crc32c

try:
    from l2fs.worker.store import Store
except ImportError:  # the flat layout of before the split into role packages
    from l2fs.worker.store import Store  # type: ignore[no-redef]

from l2fs.cli import main

MODE = sys.argv[1]
_receive, _adopt = Store.receive, Store.adopt


def _flipped(chunks: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    first = True
    for c in chunks:
        if first and len(c):
            c = bytes([c[0] ^ 0xFF]) + bytes(c[1:])
            first = False
        yield c


def _cover(store: Any, b: Any, writer_crc: int) -> Any:
    """The block as stored now has altered bytes; answer (and keep in the manifest) the CRC MODE says."""
    path = store.local_path(b)
    with open(path, "rb") as f:
        data = f.read()
    b.crc32c = crc32c.crc32c(data) if MODE == "own-crc" else writer_crc
    with store.lock:
        store.dirs[b.dir_idx].db.execute("UPDATE blocks SET crc32c=? WHERE block_id=?", (b.crc32c, b.block_id))
    return b


def receive(self: Any, bid: str, path: str, size: int, order_hint: int, chunks: Iterable[bytes | memoryview]) -> Any:
    honest = [0]

    def counted() -> Iterator[bytes | memoryview]:
        for c in chunks:
            honest[0] = crc32c.crc32c(c, value=honest[0])
            yield c

    b = _receive(self, bid, path, size, order_hint, _flipped(counted()))
    return _cover(self, b, honest[0])


def adopt(self: Any, bid: str, path: str, size: int, crc: int, order_hint: int) -> Any:
    b = _adopt(self, bid, path, size, crc, order_hint)  # the honest checks pass on the writer's bytes ...
    p = self.local_path(b)
    with open(p, "r+b") as f:  # ... then the stored copy is altered behind them
        first = f.read(1)
        if first:
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
    return _cover(self, b, crc)


Store.receive = receive  # type: ignore[method-assign]
Store.adopt = adopt  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[2:]]))
