"""Locating files: Stat with the last-known-location fallback and the locate_many prefetch."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from l2fs.client.core import ClientCore, _check
from l2fs.client.errors import InvalidPath, L2fsError, Unavailable
from l2fs.common import MAX_BATCH_ITEMS
from l2fs.common.capability import expiry_of
from l2fs.proto import l2fs_pb2 as pb


class _CapDenied(Exception):
    """A worker refused the block capability a read carried (Client._read locates once more)."""


def _caps_valid(st: pb.FileStat) -> bool:
    """Whether no location's capability has expired by this host's clock (the worker allows some skew)."""
    now = time.time()
    for loc in st.locations:
        exp = expiry_of(loc.capability) if loc.capability else None
        if exp is not None and now > exp:
            return False
    return True


class LocateOps(ClientCore):
    """Where a path's block is, for the read path."""


    def _locate(self, path: str, deadline: float) -> pb.FileStat | None:
        now = time.monotonic()
        with self._lock:
            cached = self._located.get(path)
            pre = self._prefetched.pop(path, None)
        if pre is not None and now < pre[1]:
            return self._remember(path, pre[0])
        if cached is not None and not _caps_valid(cached):
            self._forget(path)  # its capabilities expired: useless even while the master is down
            cached = None
        shard = self._shard_of(path)
        if now < self._shards[shard].down_until:
            return cached  # the master just failed: last known location, or a miss without waiting
        # With a fallback, leave most of the deadline for the read itself.
        mdeadline = min(deadline, now + self.timeout / 4) if cached is not None else deadline
        try:
            st = self._master("Stat", pb.PathRequest(path=path), mdeadline, shard)
        except Unavailable:
            self._pause_master(shard)
            return cached
        except L2fsError as e:
            if isinstance(e, InvalidPath):
                raise
            return None
        return self._remember(path, st)


    def _remember(self, path: str, st: pb.FileStat) -> pb.FileStat | None:
        """A fresh Stat answer: keep a readable file's location (fallback cache), forget anything else."""
        if not st.exists or st.is_dir or not st.locations:
            self._forget(path)
            return None
        with self._lock:
            self._located[path] = st
            self._located.move_to_end(path)
            if len(self._located) > self._LOCATED_MAX:
                self._located.popitem(last=False)
        return st


    def locate_many(self, paths: Sequence[str], *, _deadline: float | None = None) -> int:
        """Look up where a batch of files lives in ONE master round trip (StatMany), so the next read of each
        path (get / get_into, once, within `timeout`) skips its own Stat RPC. Returns how many exist.

        A hint: any fault (master unreachable, deadline) returns 0 and the reads locate one by one as
        before; invalid paths raise InvalidPath like the reads would. Measured on 31 chunks of 1 MiB: one
        StatMany ~2 ms vs ~26 ms for 31 Stats (`kvtier bench chunk-read`)."""
        if len(paths) > MAX_BATCH_ITEMS:  # the master takes MAX_BATCH_ITEMS per call
            end = _deadline if _deadline is not None else time.monotonic() + self.timeout
            return sum(self.locate_many(paths[k:k + MAX_BATCH_ITEMS], _deadline=end)
                       for k in range(0, len(paths), MAX_BATCH_ITEMS))
        norm = [_check(p) for p in paths]
        now = time.monotonic()
        deadline = _deadline if _deadline is not None else now + self.timeout
        if not norm or now >= deadline:
            return 0
        parts = {s: idx for s, idx in self._split(norm).items() if now >= self._shards[s].down_until}

        def one(shard: int, idx: list[int]) -> list[Any]:
            try:
                resp = self._master("StatMany", pb.PathsRequest(paths=[norm[i] for i in idx]), deadline, shard)
            except Unavailable:
                self._pause_master(shard)
                return []
            return list(resp.stats) if len(resp.stats) == len(idx) else []

        found: list[tuple[str, Any]] = []
        for idx, stats in zip(parts.values(), self._fan([functools.partial(one, s, idx)
                                                         for s, idx in parts.items()]), strict=True):
            if isinstance(stats, list):  # any fault of a shard: its paths locate one by one as before
                found += [(norm[i], st) for i, st in zip(idx, stats, strict=False)]
        expiry = time.monotonic() + self.timeout
        with self._lock:
            if len(self._prefetched) > self._LOCATED_MAX:  # batches that were never read
                self._prefetched = {p: v for p, v in self._prefetched.items() if v[1] > now}
            for p, st in found:
                self._prefetched[p] = (st, expiry)
        return sum(1 for _, st in found if st.exists and not st.is_dir and st.locations)
