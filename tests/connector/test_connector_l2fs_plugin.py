"""The LMCache l2fs plugin driven through LMCache's own StorageManager/RemoteBackend against a real LocalCluster.

No vLLM here: real LMCache objects (config, metadata, StorageManager, LocalCPUBackend, RemoteBackend) and real
l2fs master/worker processes on loopback.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from polling import wait_until

pytest.importorskip("lmcache")

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from connector import keys as ckeys
from connector.config import lmcache_config
from connector.fingerprint import record_and_check
from l2fs.common import free_port
from l2fs.testing.cluster import LocalCluster

MODEL = "org/tiny@v1%x"  # '/', '@' and '%' must all survive the file name
SHAPE = torch.Size([2, 4, 256, 128])
PREFIX = "/kvtier/kv"


def _metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float32, kv_shape=(4, 2, 256, 2, 64))


def _manager(master: str, node: str, extra: dict | None = None, l2_timeout: float = 5.0, **over) -> StorageManager:
    """A real LMCache StorageManager whose L2 is our plugin; `extra`: more extra_config keys. l2_timeout: 5 s, not
    the deployed 1 s: these tests are about what is stored and found, and a put that misses its deadline on a
    loaded box is (rightly) dropped, which would fail them for the wrong reason."""
    d = lmcache_config(chunk_size=256, l1_gb=0.1, l2fs_master=master, node_id=node, prefix=PREFIX,
                       l2_timeout=l2_timeout)
    d.pop("remote_serde")
    d["extra_config"] = {**d["extra_config"], **(extra or {})}
    d.update(over)
    cfg = LMCacheEngineConfig.from_defaults(**d)
    return StorageManager(cfg, _metadata(), EventManager())


def _key(h: int) -> CacheEngineKey:
    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=h, dtype=torch.float32)


def _put(sm: StorageManager, keys: list[CacheEngineKey], seed: int) -> list[torch.Tensor]:
    datas = []
    objs = []
    for i, _ in enumerate(keys):
        obj = sm.allocate(SHAPE, torch.float32, MemoryFormat.KV_2LTD)
        g = torch.Generator().manual_seed(seed * 1000 + i)
        obj.tensor.copy_(torch.randn(SHAPE, generator=g))
        datas.append(obj.tensor.clone())
        objs.append(obj)
    sm.batched_put(keys, objs)
    return datas


def _wait_exists(client, paths: list[str], timeout: float = 20.0) -> None:
    try:
        wait_until(lambda: client.prefix_lookup(paths) == len(paths), timeout, 0.1)
    except AssertionError:
        raise AssertionError(f"chunks not in l2fs after {timeout}s") from None


def _rpc_counts(cluster: LocalCluster) -> dict[str, float]:
    """Master RPCs served so far, by method (from the master's Prometheus endpoint)."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.master_metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^l2fs_master_rpc_seconds_count\{method="(\w+)"\} (\S+)$', text, re.M)}


def _remote(sm: StorageManager):
    return next(b for n, b in sm.storage_backends.items() if n.startswith("RemoteBackend"))


def _conn(sm: StorageManager):
    """Our L2fsConnector inside LMCache's InstrumentedRemoteConnector wrapper."""
    return _remote(sm).connection._connector


def test_key_names_are_reversible() -> None:
    for h in (0, 1, -1, 2**63 - 1, -(2**63), 0xDEADBEEF):
        k = _key(h)
        name = ckeys.key_to_name(k)
        assert "/" not in name and ckeys.name_to_key(name) == k
    tagged = CacheEngineKey(model_name="a/b", world_size=2, worker_id=1, chunk_hash=-7, dtype=torch.bfloat16,
                            request_configs={"lmcache.tag.user": "x@y/z"})
    assert ckeys.name_to_key(ckeys.key_to_name(tagged)) == tagged
    with pytest.raises(ValueError):
        ckeys.name_to_key("junk.data")


def test_cross_node_put_contains_get(cluster: LocalCluster) -> None:
    a = _manager(cluster.master, "node-1")
    b = _manager(cluster.master, "node-2")
    client = cluster.client()
    try:
        keys = [_key(h) for h in (11, -22, 33)]
        datas = _put(a, keys, seed=1)
        _wait_exists(client, [ckeys.key_path(PREFIX, k) for k in keys])
        # files: reversible names, LMCache fs-connector header + raw bytes
        infos = client.ls(ckeys.model_dir(PREFIX, MODEL))
        assert {ckeys.name_to_key(i.path.rsplit("/", 1)[-1]) for i in infos} >= set(keys)
        raw = client.get(ckeys.key_path(PREFIX, keys[1]))
        conn = _conn(a)
        hdr = conn.remote_metadata_bytes
        md = RemoteMetadata.deserialize(raw[:hdr])
        assert md.length == len(raw) - hdr == SHAPE.numel() * 4 and md.fmt == MemoryFormat.KV_2LTD

        # node-2 has an empty L1: prefix contains goes to l2fs; a hole stops the prefix
        hits, _ = b.batched_contains(keys)
        assert hits == 3
        before = _rpc_counts(cluster)
        assert _remote(b).batched_contains([keys[0], keys[1], _key(999), keys[2]]) == 2
        after = _rpc_counts(cluster)
        assert after.get("PrefixLookup", 0) - before.get("PrefixLookup", 0) == 1  # one RPC for 4 keys
        assert after.get("Stat", 0) == before.get("Stat", 0)
        for k, d in zip(keys, datas, strict=True):
            obj = b.get(k)
            assert obj is not None and torch.equal(obj.tensor, d)
            obj.ref_count_down()
    finally:
        a.close()
        b.close()
        client.close()


def test_put_if_absent_keeps_first_version(cluster: LocalCluster) -> None:
    a = _manager(cluster.master, "node-1")
    b = _manager(cluster.master, "node-2")
    client = cluster.client()
    try:
        k = _key(4242)
        first = _put(a, [k], seed=7)[0]
        _wait_exists(client, [ckeys.key_path(PREFIX, k)])
        before = client.get(ckeys.key_path(PREFIX, k))
        _put(b, [k], seed=8)  # same key, other bytes (would be a bug upstream; must not clobber)
        time.sleep(1.0)
        assert client.get(ckeys.key_path(PREFIX, k)) == before
        c = _manager(cluster.master, "node-2")
        try:
            obj = c.get(k)
            assert obj is not None and torch.equal(obj.tensor, first)
            obj.ref_count_down()
        finally:
            c.close()
    finally:
        a.close()
        b.close()
        client.close()


def test_corrupted_chunks_are_misses(cluster: LocalCluster, tmp_path: Path) -> None:
    client = cluster.client()
    sm = _manager(cluster.master, "node-2")
    try:
        conn = _conn(sm)
        hdr = conn.remote_metadata_bytes
        # 3) bytes flipped on a worker's disk: l2fs's CRC turns it into a miss
        k3 = _key(5003)
        a = _manager(cluster.master, "node-1")
        try:
            _put(a, [k3], seed=3)
            _wait_exists(client, [ckeys.key_path(PREFIX, k3)])
        finally:
            a.close()
        flipped = 0
        for w in cluster.workers:
            for f in w.data_dir.rglob("*"):
                if f.is_file() and f.stat().st_size == hdr + SHAPE.numel() * 4:
                    b = bytearray(f.read_bytes())
                    b[hdr + 10] ^= 0xFF
                    f.write_bytes(bytes(b))
                    flipped += 1
        assert flipped >= 1
        # 1) header says more bytes than the file holds
        k1 = _key(5001)
        good = RemoteMetadata(SHAPE.numel() * 4, [SHAPE], [torch.float32], MemoryFormat.KV_2LTD).serialize()
        client.put(ckeys.key_path(PREFIX, k1), good + b"\0" * 100, if_absent=False)
        # 2) garbage header
        k2 = _key(5002)
        client.put(ckeys.key_path(PREFIX, k2), b"\xff" * (hdr + SHAPE.numel() * 4), if_absent=False)
        for k in (k1, k2, k3):
            assert sm.get(k) is None
        assert conn.stats["corrupt"] >= 2
    finally:
        sm.close()
        client.close()


def test_unreachable_master_is_l1_only_without_stalls(caplog: pytest.LogCaptureFixture) -> None:
    dead = f"127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, logger="kvtier.connector.l2fs")
    t0 = time.monotonic()
    sm = _manager(dead, "node-1")
    try:
        assert time.monotonic() - t0 < 10  # construction does not wait for the master
        assert _remote(sm).connection is not None  # the backend exists: L2 comes back by itself when the master does
        conn = _conn(sm)
        keys = [_key(h) for h in range(700, 708)]
        datas = _put(sm, keys, seed=5)  # L1 keeps working
        wait_until(lambda: conn.breaker.down, 10)
        t1 = time.monotonic()
        for _ in range(20):
            assert _remote(sm).batched_contains(keys) == 0
        assert time.monotonic() - t1 < 0.5  # no per-request RPC deadline while the master is down
        obj = sm.get(keys[3])  # served from L1
        assert obj is not None and torch.equal(obj.tensor, datas[3])
        obj.ref_count_down()
        warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        sm.close()


def test_key_mismatch_is_reported_loudly(cluster: LocalCluster, caplog: pytest.LogCaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    client = cluster.client()
    caplog.set_level(logging.ERROR, logger="kvtier.connector.fingerprint")
    try:
        md = _metadata()
        md.model_name = "mismatch/model"
        ok = LMCacheEngineConfig.from_defaults(chunk_size=256)
        monkeypatch.setenv("PYTHONHASHSEED", "0")
        monkeypatch.setenv("KVTIER_REPLICA_ID", "rep-a")
        assert record_and_check(client, ok, md, node_id="node-1") == []
        monkeypatch.setenv("KVTIER_REPLICA_ID", "rep-a2")
        assert record_and_check(client, ok, md, node_id="node-2") == []  # same keys: silent
        assert not [r for r in caplog.records if "KEY MISMATCH" in r.getMessage()]
        monkeypatch.setenv("KVTIER_REPLICA_ID", "rep-b")
        monkeypatch.setenv("PYTHONHASHSEED", "1")
        other = LMCacheEngineConfig.from_defaults(chunk_size=128)
        bad = record_and_check(client, other, md, node_id="node-2")
        assert {r["replica"] for r in bad} == {"rep-a", "rep-a2"}
        msgs = [r.getMessage() for r in caplog.records if "KVTIER KEY MISMATCH" in r.getMessage()]
        assert msgs and "chunk_size" in msgs[0] and "python_hash_seed" in msgs[0]
    finally:
        client.close()


def test_batched_get_one_statmany_and_per_chunk_misses(cluster: LocalCluster) -> None:
    """LMCache's batched get: one StatMany for the batch (no Stat per chunk); a missing or corrupted chunk is a
    miss for that chunk only, the others load intact."""
    a = _manager(cluster.master, "node-1")
    b = _manager(cluster.master, "node-2")
    client = cluster.client()
    try:
        keys = [_key(h) for h in range(8100, 8106)]
        datas = _put(a, keys, seed=11)
        paths = [ckeys.key_path(PREFIX, k) for k in keys]
        _wait_exists(client, paths)
        hdr = _conn(b).remote_metadata_bytes
        good = client.get(paths[2])
        client.put(paths[2], good[:hdr] + good[hdr:-8], if_absent=False)  # header/length mismatch: corrupt
        assert client.rm(paths[4])  # missing
        batch = [*keys, _key(8199)]  # and one that never existed
        before = _rpc_counts(cluster)
        objs = _remote(b).batched_get_blocking(batch)
        after = _rpc_counts(cluster)
        assert after.get("StatMany", 0) - before.get("StatMany", 0) == 1
        assert after.get("Stat", 0) == before.get("Stat", 0)
        assert [o is not None for o in objs] == [True, True, False, True, False, True, False]
        for i in (0, 1, 3, 5):
            assert torch.equal(objs[i].tensor, datas[i])
            objs[i].ref_count_down()
        assert _conn(b).stats["corrupt"] >= 1
    finally:
        a.close()
        b.close()
        client.close()


@pytest.mark.parametrize("node", ["node-1", "node-2"], ids=["same-node", "cross-node"])
def test_chunks_are_read_straight_into_l1_objects(cluster: LocalCluster, node: str) -> None:
    """A full chunk is read into the L1 object LMCache hands out (header into a small buffer, KV straight into the
    object: one allocation, no staging copy); a chunk of another geometry (a partial last chunk, another memory
    format) is moved once into an object of its own shape; a corrupt or missing chunk is a miss that gives its L1
    object back."""
    w = _manager(cluster.master, "node-1")
    r = _manager(cluster.master, node)
    client = cluster.client()
    try:
        full = _key(9001)
        data = _put(w, [full], seed=21)[0]
        conn = _conn(r)
        partial, other_fmt, broken = _key(9002), _key(9003), _key(9004)
        part_shape = torch.Size([2, 4, 100, 128])
        part = torch.randn(part_shape, generator=torch.Generator().manual_seed(22))
        client.put(ckeys.key_path(PREFIX, partial), RemoteMetadata(
            part.numel() * 4, [part_shape], [torch.float32], MemoryFormat.KV_2LTD).serialize()
            + part.numpy().tobytes(), if_absent=False)
        t2d_shape = torch.Size([256, 2, 512])  # KV_T2D, as a layerwise store writes: same bytes, other shape
        t2d = torch.randn(t2d_shape, generator=torch.Generator().manual_seed(23))
        client.put(ckeys.key_path(PREFIX, other_fmt), RemoteMetadata(
            t2d.numel() * 4, [t2d_shape], [torch.float32], MemoryFormat.KV_T2D).serialize()
            + t2d.numpy().tobytes(), if_absent=False)
        good = client.get(ckeys.key_path(PREFIX, full))
        hdr = conn.remote_metadata_bytes
        # the engine's geometry in the header, 4 bytes fewer after it: a header-length lie
        client.put(ckeys.key_path(PREFIX, broken), bytes(good[:hdr]) + bytes(good[hdr:-4]), if_absent=False)
        _wait_exists(client, [ckeys.key_path(PREFIX, k) for k in (full, partial, other_fmt, broken)])

        allocated: list = []
        real = conn.local_cpu_backend.allocate

        def allocate(*a, **kw):
            obj = real(*a, **kw)
            allocated.append(obj)
            return obj

        into: list = []  # the destinations l2fs was given
        real_get_into = conn.client.get_into

        def get_into(path, buf, **kw):
            into.append(buf)
            return real_get_into(path, buf, **kw)

        conn.local_cpu_backend.allocate = allocate
        conn.client.get_into = get_into
        try:
            obj = conn._get_sync(full)
            assert obj is not None and torch.equal(obj.tensor, data)
            assert len(allocated) == 1 and allocated[0] is obj  # no second object
            # the KV was read into the object itself (no staging buffer to copy from)
            assert len(into) == 1 and any(np.shares_memory(np.asarray(b), obj.tensor.numpy()) for b in into[0]
                                          if not isinstance(b, bytearray))
            obj.ref_count_down()

            allocated.clear()
            obj = conn._get_sync(partial)
            assert obj is not None and obj.tensor.shape == part_shape and torch.equal(obj.tensor, part)
            assert len(allocated) == 2 and allocated[1] is obj and allocated[0].get_ref_count() == 0
            obj.ref_count_down()

            allocated.clear()
            obj = conn._get_sync(other_fmt)
            assert obj is not None and obj.get_memory_format() == MemoryFormat.KV_T2D and torch.equal(obj.tensor, t2d)
            assert len(allocated) == 2 and allocated[0].get_ref_count() == 0
            obj.ref_count_down()

            for k in (broken, _key(9099)):  # corrupt (header length vs bytes), never stored
                allocated.clear()
                assert conn._get_sync(k) is None
                assert allocated and all(o.get_ref_count() == 0 for o in allocated)
        finally:
            conn.local_cpu_backend.allocate = real
            conn.client.get_into = real_get_into
        assert conn.stats["corrupt"] >= 1 and conn.stats["get_miss"] >= 1
    finally:
        w.close()
        r.close()
        client.close()
