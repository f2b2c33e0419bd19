"""The passthrough mount's cross-node copies (`BlockCache`), in process against a real LocalCluster: fetched by
splice into the cache file, and through a buffer when the cache directory's file system refuses splice."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest

from l2fs.dataplane.client import SpliceUnsupported
from l2fs.fuse.passthrough import BlockCache, Counters, Reply
from l2fs.proto import l2fs_pb2 as pb
from l2fs.testing.cluster import LocalCluster

MIB = 1 << 20


def _copy(cache: BlockCache, path: str) -> bytes:
    """Open path's node-1 block through the cache (fetching it if absent) and return the copy's bytes."""
    c = cache.client
    st_ = c._master("Stat", pb.PathRequest(path=path))
    fd, name = cache.open(st_, st_.locations[0], time.monotonic() + 10)
    try:
        return os.pread(fd, st_.size + 1, 0)
    finally:
        os.close(fd)
        cache.release(name)


def test_copies_are_spliced_and_fall_back_to_a_buffer_without_splice(
        cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = {f"/fetch/{i}": os.urandom(3 * MIB + i) for i in range(3)}
    with cluster.client(node_id="node-1") as c1:
        for p, d in blobs.items():
            assert c1.put(p, d)
    with cluster.client(node_id="node-2") as c2:
        cache = BlockCache(c2, str(tmp_path), 1 << 30, Counters())
        assert _copy(cache, "/fetch/0") == blobs["/fetch/0"] and cache.splice  # spliced
        calls: list[Any] = []

        def refuse(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            raise SpliceUnsupported(errno.EINVAL, "splice into this file is not supported")

        monkeypatch.setattr(c2._data, "read_to_file", refuse)
        assert _copy(cache, "/fetch/1") == blobs["/fetch/1"]  # refused once: the same open reads through a buffer
        assert not cache.splice and len(calls) == 1
        assert _copy(cache, "/fetch/2") == blobs["/fetch/2"] and len(calls) == 1  # not asked again
        assert _copy(cache, "/fetch/0") == blobs["/fetch/0"]  # the spliced copy is still served
        assert cache.counters.v["cache_fetches"] == 3 and cache.counters.v["cache_hits"] == 1


def test_without_data_plane_a_copy_is_the_located_version(cluster: LocalCluster, tmp_path: Path) -> None:
    """gRPC-only clusters (TLS): the copy is read by the located block's id. Reading by path, a rewrite between
    the mount's Stat and its read filed the newer version's bytes under the older version's name (the cache file
    is named by block id and CRC), so later opens of the old version got bytes that fail its CRC."""
    old, new = os.urandom(2 * MIB), os.urandom(2 * MIB)  # same size: a size check alone cannot tell them apart
    with cluster.client(node_id="node-1") as c1, cluster.client(node_id="node-2", data_plane=False) as c2:
        cache = BlockCache(c2, str(tmp_path), 1 << 30, Counters())
        assert c1.put("/fetch/other", new)
        assert _copy(cache, "/fetch/other") == new  # a copy over gRPC by block id works at all
        assert c1.put("/fetch/v", old)
        st_ = c2._master("Stat", pb.PathRequest(path="/fetch/v"))
        assert c1.put("/fetch/v", new, if_absent=False)  # rewritten after the Stat, before the read
        try:
            fd, name = cache.open(st_, st_.locations[0], time.monotonic() + 10)
        except Reply as e:  # the old block already released: a miss (EIO), never the new bytes
            assert e.code == errno.EIO
            return
        try:
            got = os.pread(fd, len(old) + 1, 0)
        finally:
            os.close(fd)
            cache.release(name)
        assert got == old, "the copy filed under the old version's name holds other bytes"
