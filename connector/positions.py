"""Absolute chunk positions for l2fs order hints ("deepest chunk of a prefix chain is evicted first").

Why this exists: an LMCache key (`CacheEngineKey` in-process, `ObjectKey` in MP mode) holds the chunk's
prefix *hash*, not its position, and the remote connector / L2 adapter only receives keys and bytes. The
batch order is not the position either: a store after a cache hit only holds the new chunks of an extended
prefix (LMCache masks the cached ones), so its first chunk may be chunk 7 of the prompt. The position is
known where LMCache turns tokens into keys, so we record it there:

* in-process: `ChunkedTokenDatabase.process_tokens` yields `(start, end, key)` with `start` the token offset
  from the start of the prompt (also for masked stores); index = start // chunk_size.
* MP mode: `Session.get_hashes(start, end)` returns the hashes of chunks [start // chunk_size, ...); the
  adapter's `ObjectKey.chunk_hash` is `TokenHasher.hash_to_bytes(h)` of those.

Both hooks wrap the class method once per process (idempotent) and only record; LMCache's results are
passed through unchanged. The map is a bounded LRU (a chunk is put shortly after its key is made), and a
chunk hash names a whole prefix chain, so one hash always has one position. A key not in the map (evicted
from it, or made by code that bypasses these hooks) gets hint 0, the old behaviour.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

log = logging.getLogger("kvtier.connector.positions")

DEFAULT_CAPACITY = 1 << 17  # ~130k chunks = 32M tokens at 256 tokens/chunk; a few MB of dict


class ChunkIndex:
    """Thread-safe bounded LRU: chunk hash -> absolute chunk index in its prompt."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._d: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, chunk_hash: Hashable, index: int) -> None:
        with self._lock:
            self._d[chunk_hash] = index
            self._d.move_to_end(chunk_hash)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def get(self, chunk_hash: Hashable) -> int | None:
        with self._lock:
            return self._d.get(chunk_hash)

    def hints(self, chunk_hashes: Iterable[Hashable]) -> list[int]:
        """Order hints for a batch: the recorded index, else 0 (unknown: no preference)."""
        with self._lock:
            return [self._d.get(h, 0) for h in chunk_hashes]

    def __len__(self) -> int:
        return len(self._d)


INDEX = ChunkIndex()
_installed: set[str] = set()
_install_lock = threading.Lock()


def _record_tokens(gen: Iterator[Any], chunk_size: int) -> Iterator[Any]:
    for item in gen:
        start, _end, key = item
        INDEX.record(getattr(key, "chunk_hash", key), start // chunk_size)
        yield item


def install_inprocess() -> bool:
    """Wrap LMCache's ChunkedTokenDatabase.process_tokens to record key -> chunk index. True once installed."""
    with _install_lock:
        if "inprocess" in _installed:
            return True
        try:
            from lmcache.v1.token_database import ChunkedTokenDatabase
        except Exception as e:  # noqa: BLE001 - no LMCache: hints stay 0
            log.warning("kvtier: chunk positions unavailable (%s): order hints stay 0", e)
            return False
        orig = ChunkedTokenDatabase.process_tokens

        @functools.wraps(orig)
        def process_tokens(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            return _record_tokens(orig(self, *args, **kwargs), int(self.chunk_size))

        ChunkedTokenDatabase.process_tokens = process_tokens
        _installed.add("inprocess")
        return True


def install_mp() -> bool:
    """Wrap LMCache MP's Session.get_hashes to record hash bytes -> chunk index. True once installed."""
    with _install_lock:
        if "mp" in _installed:
            return True
        try:
            from lmcache.v1.multiprocess.session import Session
            from lmcache.v1.multiprocess.token_hasher import TokenHasher
        except Exception as e:  # noqa: BLE001
            log.warning("kvtier: MP chunk positions unavailable (%s): order hints stay 0", e)
            return False
        orig = Session.get_hashes

        @functools.wraps(orig)
        def get_hashes(self: Any, start: int, *args: Any, **kwargs: Any) -> list:
            hashes = orig(self, start, *args, **kwargs)
            first = start // int(self.hasher.chunk_size)
            for i, h in enumerate(hashes):
                INDEX.record(TokenHasher.hash_to_bytes(h), first + i)
            return hashes

        Session.get_hashes = get_hashes
        _installed.add("mp")
        return True
