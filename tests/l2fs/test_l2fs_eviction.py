"""Eviction: on by default, keeps each worker under the high watermark, never ENOSPC, LRU by read,
deepest chain position first, and stat/prefix_lookup never pin anything."""

from __future__ import annotations

import time

import pytest
from l2fs_helpers import block_files, wait_until

from l2fs.testing.cluster import LocalCluster

MB = 1 << 20
CAP = 40 * MB


@pytest.fixture()
def ecluster(make_cluster):
    return make_cluster(1, capacity="40M", heartbeat_interval=0.2)


def _disk_used(cluster: LocalCluster) -> int:
    return sum(f.stat().st_size for f in block_files(cluster, 0))


def test_fill_twice_capacity_never_fails_and_stays_under_watermark(ecluster: LocalCluster) -> None:
    c = ecluster.client(node_id="node-1")
    written = 0
    for i in range(40):  # 80 MiB into a 40 MiB worker
        assert c.put(f"/fill/{i}", bytes([i]) * (2 * MB)) is True
        written += 2 * MB
        assert _disk_used(ecluster) <= 0.9 * CAP
    assert written >= 2 * CAP
    # the newest objects survive and read back intact; evicted ones are clean misses
    assert c.get("/fill/39") == bytes([39]) * (2 * MB)
    assert c.get("/fill/0") is None
    # the master learns about evictions: it lists nothing that the worker no longer holds
    wait_until(lambda: all(c.get(i.path) is not None for i in c.ls("/fill")), timeout=5)
    assert len(c.ls("/fill")) == len(block_files(ecluster, 0))


def test_lru_by_read_and_stat_does_not_pin(ecluster: LocalCluster) -> None:
    c = ecluster.client(node_id="node-1")
    c.put("/lru/read-me", b"r" * (2 * MB))
    c.put("/lru/stat-me", b"s" * (2 * MB))
    time.sleep(1.1)  # eviction compares read times at 1 s granularity
    for i in range(30):
        if i % 3 == 0:
            assert c.get("/lru/read-me") is not None  # reading renews it
            st = c.stat("/lru/stat-me")  # stat-ing and lookups do not renew
            assert c.prefix_lookup(["/lru/stat-me"]) == (st is not None)
            assert i > 0 or st is not None
            time.sleep(1.05)
        c.put(f"/lru/filler{i}", b"f" * (2 * MB))
    assert c.get("/lru/read-me") == b"r" * (2 * MB)
    wait_until(lambda: c.stat("/lru/stat-me") is None, timeout=5)


def test_deepest_chain_chunks_evicted_first(ecluster: LocalCluster) -> None:
    c = ecluster.client(node_id="node-1")
    chain = [f"/chain/{k}" for k in range(10)]
    # written in reverse order so plain LRU-by-write would evict chunk 9 last
    for k in reversed(range(10)):
        c.put(chain[k], bytes([k]) * (2 * MB), order_hint=k)
    time.sleep(1.1)
    for i in range(12):  # 24 MiB of newer data forces part of the chain out
        c.put(f"/chain-filler/{i}", b"f" * (2 * MB))
    wait_until(lambda: c.prefix_lookup(chain) < 10, timeout=5)
    present = [c.get(p) is not None for p in chain]
    n = c.prefix_lookup(chain)
    assert n > 0, "chunk 0 should outlive deeper chunks"
    assert present == [True] * n + [False] * (10 - n), f"not a prefix: {present}"
