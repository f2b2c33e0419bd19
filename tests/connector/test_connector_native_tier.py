"""The l2fs secondary tier for vLLM's native offloading, driven THROUGH vLLM's own TieringOffloadingSpec and
TieringOffloadingManager (CPU primary tier = vLLM's shared-memory region, a memoryview) against a real l2fs
master + workers. The tier is loaded by `module_path` by vLLM's SecondaryTierFactory.

Two "replicas" are two managers (own primary tiers, own l2fs clients on node-1 / node-2): what one stores
the other loads, byte for byte; lookups are one StatMany per request batch; stores are put-if-absent; KV
events carry medium STORAGE and the tier's locality; stats reach vLLM's OffloadingConnectorStats. vLLM's own
`fs` tier on an l2fs FUSE mount reads the same files (same layout). A drifted vLLM hash stops the writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

from vllm.v1.kv_offload.base import Locality, Medium

from connector import vllm_native_l2fs as nt
from kvtier import contract
from kvtier.bench.native_tier import Engine, block_keys, fs_tier, l2fs_tier
from l2fs.testing.cluster import LocalCluster

BLOCK = 64 << 10
N = 8


def _rpc_counts(cluster: LocalCluster) -> dict[str, float]:
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.master_metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^l2fs_master_rpc_seconds_count\{method="(\w+)"\} (\S+)$', text, re.M)}


def _payload(seed: int, n: int = N) -> list[bytes]:
    import random

    rng = random.Random(seed)
    return [rng.randbytes(BLOCK) for _ in range(n)]


def _tokens(seed: int, n: int = N) -> list[int]:
    return [(seed * 7919 + i * 31) % 50257 for i in range(n * 16)]


def test_cross_replica_load_batched_lookup_put_if_absent_events_stats(cluster: LocalCluster) -> None:
    keys, data = block_keys(_tokens(1)), _payload(1)
    a = Engine(BLOCK, [l2fs_tier(cluster.master, "node-1", enable_kv_events=True)], N)
    b = Engine(BLOCK, [l2fs_tier(cluster.master, "node-2")], N)
    c = Engine(BLOCK, [l2fs_tier(cluster.master, "node-2")], N)
    client = cluster.client()
    try:
        assert isinstance(a.tier, nt.L2fsTier) and a.tier.key_check.state == contract.KEY_OK
        a.store("r1", keys, data)
        assert a.tier.totals[nt.M_STORE_NEW] == N
        stored = [ev for ev in a.manager.take_events() if ev.medium is Medium.STORAGE]
        assert len(stored) == 1 and not stored[0].removed and stored[0].locality is Locality.REMOTE
        assert list(stored[0].keys) == keys
        paths = [a.tier.file_mapper.get_file_name(k) for k in keys]
        assert client.prefix_lookup(paths) == N and client.get(paths[3]) == data[3]

        before = _rpc_counts(cluster)
        got = b.fetch("r2", keys)  # another replica, empty primary tier: lookups, promotion, bytes
        assert got == data
        after = _rpc_counts(cluster)
        # the master saw one StatMany for the lookups and one for locating the load, no Stat per block
        assert after.get("StatMany", 0) - before.get("StatMany", 0) == 2
        assert after.get("Stat", 0) == before.get("Stat", 0)
        assert b.tier.totals[nt.M_LOOKUP_RPCS] == 1 and b.tier.totals[nt.M_LOOKUPS] == N  # one StatMany
        assert b.tier.totals[nt.M_LOAD_BYTES] == N * BLOCK

        c.store("r3", keys, _payload(2))  # same keys, other bytes: put-if-absent keeps the first
        assert c.tier.totals[nt.M_STORE_EXISTED] == N and nt.M_STORE_NEW not in c.tier.totals
        assert client.get(paths[0]) == data[0]

        stats = b.manager.get_stats()  # vLLM's offloading stats carry the tier's counters, labelled by tier
        red = stats.reduce()
        assert red[f"{nt.M_LOOKUP_RPCS}:('L2fsTier',)"] == 1
        assert red[f"{nt.M_LOAD_BYTES}:('L2fsTier',)"] == N * BLOCK
        assert set(nt.L2fsTier.build_metric_definitions({})) >= {nt.M_LOOKUPS, nt.M_HITS, nt.M_LOAD_BYTES}

        miss = b.fetch("r4", block_keys(_tokens(99)))  # nothing stored under these: plain misses
        assert miss == [None] * N
    finally:
        for e in (a, b, c):
            e.close()
        client.close()


@pytest.mark.fuse
def test_vllm_fs_tier_on_an_l2fs_mount_reads_the_l2fs_tiers_files(cluster: LocalCluster, tmp_path: Path) -> None:
    from kvtier.bench.native_tier import _fuse_ok
    from l2fs import fuse

    why = _fuse_ok()
    if why:
        pytest.skip(why)
    keys, data = block_keys(_tokens(3)), _payload(3)
    a = Engine(BLOCK, [l2fs_tier(cluster.master, "node-1")], N)
    mnt = tmp_path / "mnt"
    proc = fuse.spawn(mnt, cluster.master, "--node-id", "node-2", log=tmp_path / "mount.log")
    try:
        a.store("w", keys, data)
        b = Engine(BLOCK, [fs_tier(str(mnt) + nt.NATIVE_PREFIX)], N)  # vLLM's own fs tier, same layout
        try:
            assert b.fetch("r", keys) == data
        finally:
            b.close()
    finally:
        a.close()
        fuse.stop(proc, mnt)


def test_a_dead_master_is_a_miss_not_a_hang(make_cluster: Callable[..., LocalCluster]) -> None:
    keys, data = block_keys(_tokens(5)), _payload(5)
    c = make_cluster(1)
    a = Engine(BLOCK, [l2fs_tier(c.master, "node-1", timeout=0.5)], N)
    b = Engine(BLOCK, [l2fs_tier(c.master, "node-1", timeout=0.5)], N)
    try:
        a.store("w", keys, data)
        c.kill_master()
        t0 = time.monotonic()
        assert b.fetch("r", keys, timeout=30) == [None] * N  # every lookup a miss, nothing raised
        assert time.monotonic() - t0 < 30
    finally:
        a.close()
        b.close()


def test_drifted_vllm_hash_stops_the_tiers_writes(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    import hashlib
    import pickle

    import vllm.utils.hashing as vh

    caplog.set_level(logging.INFO, logger="kvtier.connector.keycheck")
    # "the next vLLM": its sha256 block hash pickles with another protocol -> other keys for the same tokens
    monkeypatch.setattr(vh, "sha256", lambda x: hashlib.sha256(pickle.dumps(x, protocol=4)).digest())
    keys, data = block_keys(_tokens(7)), _payload(7)
    a = Engine(BLOCK, [l2fs_tier(cluster.master, "node-1")], N)
    client = cluster.client()
    try:
        assert a.tier.key_check.state == contract.KEY_DRIFT
        assert any(r.getMessage().startswith("KVTIER KEY DRIFT: vllm_native_l2fs") for r in caplog.records)
        a.store("w", keys, data)
        assert a.tier.totals[nt.M_DRIFT] == N and nt.M_STORE_NEW not in a.tier.totals
        assert client.prefix_lookup([a.tier.file_mapper.get_file_name(k) for k in keys]) == 0
    finally:
        a.close()
        client.close()
