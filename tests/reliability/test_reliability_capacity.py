"""Capacity: a full cache evicts, it never fails writes.

Writing 3x the cluster's capacity never raises ENOSPC (or any error); usage reported by the master and
bytes really on disk stay at or below the high watermark; and on a skewed (Zipf) cache-aside trace the
hit rate is at least that of a plain LRU cache of the same usable size, simulated on the same trace.
"""

from __future__ import annotations

import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from reliability_faults import DEADLINE, dir_bytes, files_under, lru_hit_rate, payload, wait_until, zipf_trace

WORKER_CAP = 4 << 20  # 4 MiB per worker: small, so 3x capacity is quick to write
HIGH, LOW = 0.90, 0.80  # l2fs default watermarks
OBJ = 64 << 10


def _worker_gauge(port: int, name: str) -> float:
    """One gauge from a worker's Prometheus /metrics (the worker's own accounting, not the master's)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} missing from worker metrics")


def _disk(data_dir: Path) -> tuple[int, int]:
    """(block bytes, manifest bytes) really on disk: the SQLite manifest and its WAL are metadata,
    outside the block capacity, and are reported separately."""
    meta = sum(p.stat().st_size for p in files_under(data_dir) if p.name.startswith("manifest."))
    return dir_bytes(data_dir) - meta, meta


def _usage(cluster: Any, client: Any) -> tuple[int, int, list[tuple[int, int]]]:
    """(used bytes by the workers' own gauges, capacity from the master's report, disk bytes per worker)."""
    used = sum(int(_worker_gauge(w.metrics_port, "l2fs_worker_used_bytes")) for w in cluster.workers)
    return used, client.report().capacity, [_disk(w.data_dir) for w in cluster.workers]


def test_write_3x_capacity_never_fails_and_stays_under_watermark(make_cluster: Any, record_property: Any) -> None:
    cluster = make_cluster(workers=2, capacity=str(WORKER_CAP))
    nodes = [w.node_id for w in cluster.workers]
    clients = [cluster.client(node_id=n, timeout=DEADLINE) for n in nodes]
    cap = 2 * WORKER_CAP
    n_obj = 3 * cap // OBJ
    peak_reported = peak_master = peak_disk = peak_meta = 0
    t0 = time.monotonic()
    for i in range(n_obj):
        k = f"/rel/fill/{i:05d}"
        # Both write paths: half from the worker's own node (short-circuit), half from the other.
        assert clients[i % 2].put(k, payload(i, OBJ, k), order_hint=i % 8) is True
        if i % 16 == 15:
            used, capacity, disk = _usage(cluster, clients[0])
            assert capacity == cap, f"report capacity {capacity} != configured {cap}"
            peak_reported = max(peak_reported, used)
            peak_master = max(peak_master, clients[0].report().used)  # the master's copy of the same gauges
            peak_disk = max(peak_disk, max(d for d, _ in disk))
            peak_meta = max(peak_meta, max(m for _, m in disk))
    elapsed = time.monotonic() - t0
    used, _, disk = _usage(cluster, clients[0])
    record_property("written_bytes", n_obj * OBJ)
    record_property("peak_used_fraction", round(peak_reported / cap, 3))
    record_property("peak_worker_disk_fraction", round(peak_disk / WORKER_CAP, 3))
    record_property("peak_manifest_bytes", peak_meta)
    record_property("write_MBps", round(n_obj * OBJ / elapsed / 1e6, 1))
    # One object per worker of slack: eviction runs as soon as a write crosses the watermark.
    assert peak_reported <= HIGH * cap + 2 * OBJ, f"reported usage peaked at {peak_reported / cap:.1%}"
    assert used <= HIGH * cap, f"usage settled at {used / cap:.1%} > high watermark"
    # The master reports what the workers last said, never its placement estimates (those once read 158 %).
    assert peak_master <= HIGH * cap + 2 * OBJ, f"the master reported {peak_master / cap:.1%} used"
    wait_until(lambda: clients[0].report().used <= HIGH * cap, 5)
    assert peak_disk <= HIGH * WORKER_CAP + OBJ, f"a worker's disk held {peak_disk} bytes of blocks"
    # The manifest is bounded too (the worker checkpoints the SQLite WAL every 1 MiB and truncates it to
    # 1 MiB; it reached 2.7 MiB with SQLite's 4 MiB default), whatever was written.
    assert peak_meta <= 2 << 20, f"manifest grew to {peak_meta} bytes"
    print(f"3x fill: peak used {peak_reported / cap:.1%} of capacity, peak blocks on one disk "
          f"{peak_disk / WORKER_CAP:.1%} of its capacity, manifest+WAL {peak_meta / 2**20:.1f} MiB, "
          f"{n_obj * OBJ / elapsed / 1e6:.1f} MB/s")
    # The newest objects survived (eviction drops old ones, not the ones just written).
    newest = [f"/rel/fill/{i:05d}" for i in range(n_obj - 8, n_obj)]
    assert clients[0].prefix_lookup(newest) == len(newest)
    # Something was evicted, and lookups agree with reads: nothing evicted is still claimed.
    keys = [f"/rel/fill/{i:05d}" for i in range(n_obj)]
    present = [k for k, st in zip(keys, clients[1].stat_many(keys), strict=True) if st is not None]
    assert len(present) < n_obj
    assert all(d is not None for d in clients[1].get_many(present[:40]))


def _per_worker_hit_rate(accesses: list[tuple[int, str]], capacity_bytes: int, *, fifo: bool = False) -> float:
    """Hit rate of one plain LRU (or FIFO) of `capacity_bytes` per worker, each fed the accesses that went to
    it: (key, the worker holding the key's copy at that access, or receiving its put after a miss). A key that
    was evicted from one worker and put again on the other counts on each worker for its own accesses there."""
    by_worker: dict[str, list[int]] = {}
    for k, node in accesses:
        by_worker.setdefault(node, []).append(k)
    hits = sum(lru_hit_rate(sub, capacity_bytes, lambda _k: OBJ, fifo=fifo) * len(sub) for sub in by_worker.values())
    return hits / len(accesses)


def test_zipf_hit_rate_at_least_plain_lru(make_cluster: Any, record_property: Any) -> None:
    cluster = make_cluster(workers=2, capacity=str(WORKER_CAP))
    client = cluster.client(timeout=DEADLINE)  # no node: capacity-aware placement across both workers
    n_keys, length = 400, 1500
    trace = zipf_trace(n_keys, length, s=0.9, seed=8)
    hits = 0
    placed: dict[int, str] = {}  # where each key's latest copy was put (the node its stat reports)
    accesses: list[tuple[int, str]] = []  # each access with the worker it went to
    for k in trace:
        key = f"/rel/zipf/{k:04d}"
        if client.get(key) is not None:
            hits += 1
        else:
            client.put(key, payload(k, OBJ, key))
            st = client.stat(key)
            assert st is not None and len(st.nodes) == 1, f"{key} not stored after its put: {st}"
            placed[k] = st.nodes[0]
        accesses.append((k, placed[k]))
    rate = hits / length
    # l2fs keeps between LOW and HIGH of capacity (it evicts down to LOW when a write crosses HIGH), so each
    # worker must hit at least as often as a plain LRU holding LOW x its capacity, fed the accesses that went
    # to it (exact: a worker's eviction is LRU and it never holds less than LOW). A worker that evicted a block
    # a plain LRU would keep fails this, whatever the placement. (Attributing every access of a key to its
    # latest placement instead was not exact: a key evicted from one worker and put on the other moved its
    # earlier accesses too; one CI run fell 2 accesses short that way.)
    per_worker = _per_worker_hit_rate(accesses, int(LOW * WORKER_CAP))
    fifo = _per_worker_hit_rate(accesses, int(HIGH * WORKER_CAP), fifo=True)
    # Against one global LRU of the same total size the two workers also depend on how evenly placement
    # split the objects (the master places by the free room the workers last reported, so on a loaded box
    # heartbeats lag and one worker takes more): 0.605 vs 0.608 in one CI run, 0.615-0.619 on a quiet box.
    # One percentage point (15 of 1500 accesses) of slack covers that; a broken policy loses far more
    # (FIFO eviction, even at HIGH, is printed for scale).
    lru = {f: lru_hit_rate(trace, int(f * 2 * WORKER_CAP), lambda _k: OBJ) for f in (LOW, HIGH, 1.0)}
    split = Counter(placed.values())
    record_property("hit_rate_l2fs", round(rate, 4))
    record_property("hit_rate_per_worker_lru_at_low", round(per_worker, 4))
    for f, r in lru.items():
        record_property(f"hit_rate_lru_at_{f:.2f}_capacity", round(r, 4))
    print(f"zipf hit rate: l2fs {rate:.4f}; per-worker LRU at {LOW:.0%} with l2fs's placement {per_worker:.4f}; "
          "plain LRU at " + ", ".join(f"{f:.0%}: {r:.4f}" for f, r in lru.items())
          + f"; per-worker FIFO at {HIGH:.0%} {fifo:.4f}; keys placed per node {dict(split)}")
    assert rate >= per_worker, f"l2fs hit rate {rate:.4f} < per-worker LRU {per_worker:.4f} with the same placement"
    assert rate >= lru[LOW] - 0.01, f"l2fs hit rate {rate:.3f} < plain LRU {lru[LOW]:.3f} on the same trace"
