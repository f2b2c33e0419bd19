"""Capacity: a full cache evicts, it never fails writes (issue 8, point 4).

Writing 3x the cluster's capacity never raises ENOSPC (or any error); usage reported by the master and
bytes really on disk stay at or below the high watermark; and on a skewed (Zipf) cache-aside trace the
hit rate is at least that of a plain LRU cache of the same usable size, simulated on the same trace.
"""

from __future__ import annotations

import time
from typing import Any

from conftest import DEADLINE
from reliability_faults import dir_bytes, lru_hit_rate, payload, zipf_trace

WORKER_CAP = 4 << 20  # 4 MiB per worker: small, so 3x capacity is quick to write
HIGH = 0.90  # l2fs default high watermark (issue 2)
OBJ = 64 << 10


def _usage(cluster: Any, client: Any) -> tuple[int, int, list[int]]:
    rep = client.report()
    return rep.used, rep.capacity, [dir_bytes(w.data_dir) for w in cluster.workers]


def test_write_3x_capacity_never_fails_and_stays_under_watermark(make_cluster: Any, record_property: Any) -> None:
    cluster = make_cluster(workers=2, capacity=WORKER_CAP)
    nodes = [w.node_id for w in cluster.workers]
    clients = [cluster.client(node_id=n, timeout=DEADLINE) for n in nodes]
    cap = 2 * WORKER_CAP
    n_obj = 3 * cap // OBJ
    peak_reported = peak_disk = 0
    t0 = time.monotonic()
    for i in range(n_obj):
        k = f"/rel/fill/{i:05d}"
        # Both write paths: half from the worker's own node (short-circuit), half from the other.
        assert clients[i % 2].put(k, payload(i, OBJ, k), order_hint=i % 8) is True
        if i % 16 == 15:
            used, capacity, disk = _usage(cluster, clients[0])
            assert capacity == cap, f"report capacity {capacity} != configured {cap}"
            peak_reported = max(peak_reported, used)
            peak_disk = max(peak_disk, max(disk))
    elapsed = time.monotonic() - t0
    used, _, disk = _usage(cluster, clients[0])
    record_property("written_bytes", n_obj * OBJ)
    record_property("peak_used_fraction", round(peak_reported / cap, 3))
    record_property("peak_worker_disk_fraction", round(peak_disk / WORKER_CAP, 3))
    record_property("write_MBps", round(n_obj * OBJ / elapsed / 1e6, 1))
    # One object per worker of slack: eviction runs as soon as a write crosses the watermark.
    assert peak_reported <= HIGH * cap + 2 * OBJ, f"reported usage peaked at {peak_reported / cap:.1%}"
    assert used <= HIGH * cap, f"usage settled at {used / cap:.1%} > high watermark"
    assert peak_disk <= HIGH * WORKER_CAP + OBJ + (256 << 10), f"a worker's disk held {peak_disk} bytes"
    # The newest objects survived (eviction drops old ones, not the ones just written).
    newest = [f"/rel/fill/{i:05d}" for i in range(n_obj - 8, n_obj)]
    assert clients[0].prefix_lookup(newest) == len(newest)
    # Something was evicted, and lookups agree with reads: nothing evicted is still claimed.
    keys = [f"/rel/fill/{i:05d}" for i in range(n_obj)]
    present = [k for k, st in zip(keys, clients[1].stat_many(keys), strict=True) if st is not None]
    assert len(present) < n_obj
    assert all(d is not None for d in clients[1].get_many(present[:40]))


def test_zipf_hit_rate_at_least_plain_lru(make_cluster: Any, record_property: Any) -> None:
    cluster = make_cluster(workers=2, capacity=WORKER_CAP)
    client = cluster.client(timeout=DEADLINE)  # no node: capacity-aware placement across both workers
    n_keys, length = 400, 1500
    trace = zipf_trace(n_keys, length, s=0.9, seed=8)
    hits = 0
    for k in trace:
        key = f"/rel/zipf/{k:04d}"
        if client.get(key) is not None:
            hits += 1
        else:
            client.put(key, payload(k, OBJ, key))
    rate = hits / length
    lru_high = lru_hit_rate(trace, int(HIGH * 2 * WORKER_CAP), lambda _k: OBJ)
    lru_full = lru_hit_rate(trace, 2 * WORKER_CAP, lambda _k: OBJ)
    record_property("hit_rate_l2fs", round(rate, 4))
    record_property("hit_rate_lru_at_high_watermark", round(lru_high, 4))
    record_property("hit_rate_lru_at_full_capacity", round(lru_full, 4))
    assert rate >= lru_high, f"l2fs hit rate {rate:.3f} < plain LRU {lru_high:.3f} on the same trace"
