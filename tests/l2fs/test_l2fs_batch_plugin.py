"""The LMCache plugin hands a whole `batched_put` down to one `put_many`: LMCache's own
StorageManager/RemoteBackend over our plugin against a real LocalCluster, counted on the master's RPC metrics."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402
from l2fs_helpers import master_rpcs, wait_until  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

from connector import keys as ckeys  # noqa: E402
from connector.config import lmcache_config  # noqa: E402
from connector.fingerprint import load_records  # noqa: E402
from l2fs.testing.cluster import LocalCluster  # noqa: E402

MODEL = "org/batch-model"
SHAPE = torch.Size([2, 4, 256, 128])
PREFIX = "/kvtier/kv"


@pytest.fixture(scope="module")
def cluster_options() -> dict[str, Any]:
    return {"name": "l2fs-batch-plugin"}  # 2 workers, no capacity limit


def _manager(master: str) -> StorageManager:
    d = lmcache_config(chunk_size=256, l1_gb=0.1, l2fs_master=master, node_id="node-1", prefix=PREFIX,
                       l2_timeout=2.0)
    d.pop("remote_serde")
    meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float32, kv_shape=(4, 2, 256, 2, 64))
    return StorageManager(LMCacheEngineConfig.from_defaults(**d), meta, EventManager())


def _settled(rpcs: dict[str, float]) -> dict[str, float] | None:
    """The counts once every AllocateMany so far has its CommitMany counted, else None."""
    return rpcs if rpcs.get("CommitMany", 0) >= rpcs.get("AllocateMany", 0) >= 1 else None


def test_batched_put_is_one_allocate_many_and_one_commit_many(cluster: LocalCluster) -> None:
    sm = _manager(cluster.master)
    try:
        keys = [CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=7000 + i,
                               dtype=torch.float32) for i in range(8)]
        objs = []
        for _ in keys:
            obj = sm.allocate(SHAPE, torch.float32, MemoryFormat.KV_2LTD)
            obj.tensor.normal_()
            objs.append(obj)
        with cluster.client() as c:
            # the plugin's start-up publishes its key fingerprint (one put: AllocateMany + CommitMany) in the
            # background; counted from before it finished, its CommitMany landed in our window on a loaded box
            wait_until(lambda: len(load_records(c, MODEL)) > 0, timeout=20.0)
            # ... and its CommitMany is counted when the handler returns, which can be after the committed path is
            # already listed (a CI run counted it inside our window): wait until every AllocateMany has its commit
            before = wait_until(lambda: _settled(master_rpcs(cluster)), timeout=20.0)
            sm.batched_put(keys, objs)
            paths = [ckeys.key_path(PREFIX, k) for k in keys]
            wait_until(lambda: c.prefix_lookup(paths) == len(paths), timeout=20.0)
            time.sleep(0.2)  # let the metrics of the last call land
            after = master_rpcs(cluster)
        assert after.get("AllocateMany", 0) - before.get("AllocateMany", 0) == 1
        assert after.get("CommitMany", 0) - before.get("CommitMany", 0) == 1
        assert after.get("Allocate", 0) == before.get("Allocate", 0)
    finally:
        sm.close()
