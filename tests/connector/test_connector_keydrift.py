"""Engine-side key drift: an installed LMCache that hashes chunks differently from kvtier.contract stops the
L2 writes of the in-process plugin and of the MP adapter (log line + gauge), against a real l2fs cluster.

The "next LMCache" is the installed one with its hash function monkeypatched in this process (LMCache's
TokenDatabase._get_vllm_hash_func, the MP server's blake3 maker): its keys change, ours do not. The same
components with the unpatched library write as usual (the control half of each test).
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import time

import pytest
import torch

pytest.importorskip("lmcache")

from lmcache.utils import CacheEngineKey
from lmcache.v1 import token_database as tdb
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.multiprocess import token_hasher
from lmcache.v1.storage_backend.storage_manager import StorageManager
from prometheus_client import REGISTRY

from connector.config import lmcache_config
from kvtier import contract
from l2fs.testing.cluster import LocalCluster

MODEL = "org/drift"
SHAPE = torch.Size([2, 4, 256, 128])


@pytest.fixture(scope="module")
def cluster_options() -> dict:
    return {"name": "l2fs-drift", "workers": 1}


def _gauge(component: str, state: str) -> float | None:
    return REGISTRY.get_sample_value("kvtier_key_check", {"component": component, "state": state})


def _manager(master: str, prefix: str) -> StorageManager:
    d = lmcache_config(chunk_size=256, l1_gb=0.1, l2fs_master=master, node_id="node-1", prefix=prefix,
                       l2_timeout=1.0)
    d.pop("remote_serde")
    md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.float32, kv_shape=(4, 2, 256, 2, 64))
    return StorageManager(LMCacheEngineConfig.from_defaults(**d), md, EventManager())


def _conn(sm: StorageManager):
    backend = next(b for n, b in sm.storage_backends.items() if n.startswith("RemoteBackend"))
    return backend.connection._connector


def _store_plugin(sm: StorageManager, n: int) -> None:
    keys, objs = [], []
    for i in range(n):
        keys.append(CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=9000 + i,
                                   dtype=torch.float32))
        obj = sm.allocate(SHAPE, torch.float32, MemoryFormat.KV_2LTD)
        obj.tensor.fill_(float(i))
        objs.append(obj)
    sm.batched_put(keys, objs)


def _files(client, prefix: str) -> int:
    try:
        return len(client.ls(f"{prefix}/{contract.esc(MODEL)}"))
    except Exception:  # noqa: BLE001 - no directory: nothing written
        return 0


def _record(client, replica: str) -> dict:
    """A replica's key-compat record (connector.fingerprint), once the plugin's start-up has written it."""
    path = f"{contract.META_PREFIX}/{contract.esc(MODEL)}/{replica}.json"
    t0 = time.monotonic()
    while (raw := client.get(path)) is None:
        assert time.monotonic() - t0 < 20, "the plugin never wrote its record"
        time.sleep(0.1)
    return json.loads(raw)


def test_plugin_stops_writing_when_installed_lmcache_hashes_differently(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    client = cluster.client()
    caplog.set_level(logging.INFO, logger="kvtier.connector.keycheck")
    try:
        monkeypatch.setenv("KVTIER_REPLICA_ID", "keydrift-ok")
        monkeypatch.setenv("PYTHONHASHSEED", "12345")  # not what this process's string hash is keyed by
        good = _manager(cluster.master, "/drift/ok")  # the installed LMCache as it is: keys match, writes land
        assert _conn(good).key_check.state == contract.KEY_OK
        assert _gauge("lmcache_l2fs", "ok") == 1
        _store_plugin(good, 3)
        t0 = time.monotonic()
        while _files(client, "/drift/ok") < 3:
            assert time.monotonic() - t0 < 20, "control: chunks never reached l2fs"
            time.sleep(0.1)
        # its key-compat record carries the keys its LMCache computed (what a router without LMCache checks), but
        # no seed: this process's string hash is not keyed by the PYTHONHASHSEED set here, so a router cannot
        # recompute them and takes the record as no evidence (tests/router/test_router_engine_keydrift.py runs an
        # engine started with its seed)
        rec = _record(client, "keydrift-ok")
        assert rec[contract.KAT_RECORD_FIELD]["keys"] == contract.builtin_chain(contract.KAT_TOKENS, 256,
                                                                                int(tdb.NONE_HASH))
        assert rec[contract.KAT_RECORD_FIELD]["seed"] == "" and contract.kat_record_verdict(rec) is None
        good.close()

        # "the next LMCache": same tokens, other chunk hashes
        monkeypatch.setattr(tdb.TokenDatabase, "_get_vllm_hash_func",
                            lambda self, algo: (lambda x: hash(("lmcache-next", x))))
        monkeypatch.setenv("KVTIER_REPLICA_ID", "keydrift-next")
        bad = _manager(cluster.master, "/drift/bad")
        conn = _conn(bad)
        assert conn.key_check.state == contract.KEY_DRIFT
        assert _gauge("lmcache_l2fs", "drift") == 1 and _gauge("lmcache_l2fs", "ok") == 0
        assert any(r.getMessage().startswith("KVTIER KEY DRIFT: lmcache_l2fs") for r in caplog.records)
        _store_plugin(bad, 3)
        t0 = time.monotonic()
        while conn.stats["put_drift"] < 3:
            assert time.monotonic() - t0 < 20, conn.stats
            time.sleep(0.1)
        assert _files(client, "/drift/bad") == 0 and conn.stats["put"] == 0
        rec = _record(client, "keydrift-next")
        assert rec[contract.KAT_RECORD_FIELD]["keys"] == list(conn.key_check.keys)  # the next LMCache's keys
        state, detail = contract.kat_record_verdict(rec)  # its own verdict counts, whatever the seed
        assert state == contract.KEY_DRIFT and "its own key check found drift" in detail
        bad.close()
    finally:
        client.close()


def _mp_adapter(master: str, prefix: str):
    spec = {"type": "plugin", "module_path": "connector.mp_l2fs", "class_name": "L2fsL2Adapter",
            "adapter_params": {"master": master, "node_id": "node-1", "timeout": 1.0, "prefix": prefix}}
    cfgs = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    return create_l2_adapter_from_registry(cfgs.adapters[0])


def _mp_store(ad, n: int) -> int:
    alloc = AdHocMemoryAllocator("cpu")
    objs = [alloc.allocate(torch.Size([2, 2, 256, 64]), torch.float32, MemoryFormat.KV_2LTD) for _ in range(n)]
    keys = [ObjectKey(chunk_hash=bytes([i + 1]) * 32, model_name=MODEL, kv_rank=1 << 24, cache_salt="")
            for i in range(n)]
    tid = ad.submit_store_task(keys, objs)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20:
        done = ad.pop_completed_store_tasks()
        if tid in done:
            return int(done[tid])
        select.select([ad.get_store_event_fd()], [], [], 0.2)
    raise AssertionError("store task never completed")


def test_mp_adapter_stops_storing_when_installed_lmcache_hashes_differently(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    client = cluster.client()
    caplog.set_level(logging.INFO, logger="kvtier.connector.keycheck")
    try:
        good = _mp_adapter(cluster.master, "/drift/mp-ok")
        assert good.key_check.state == contract.KEY_OK
        assert _mp_store(good, 2) > 0 and _files(client, "/drift/mp-ok") == 2
        good.close()

        real = token_hasher._make_blake3_hash_func

        def next_blake3():  # the next LMCache serializes tokens little-endian: other digests
            f = real()
            return lambda args: f((args[0], tuple(reversed(args[1])), args[2]))

        monkeypatch.setattr(token_hasher, "_make_blake3_hash_func", next_blake3)
        bad = _mp_adapter(cluster.master, "/drift/mp-bad")
        assert bad.key_check.state == contract.KEY_DRIFT
        assert _gauge("mp_l2fs", "drift") == 1
        assert any(r.getMessage().startswith("KVTIER KEY DRIFT: mp_l2fs") for r in caplog.records)
        assert _mp_store(bad, 2) == -1  # a failed store for LMCache, and nothing in l2fs
        assert _files(client, "/drift/mp-bad") == 0
        bad.close()
    finally:
        client.close()
