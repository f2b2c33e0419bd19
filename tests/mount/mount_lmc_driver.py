"""Drive stock LMCache's storage layer (StorageManager + RemoteBackend with an `fs://` remote_url) from plain
Python, as one "node": `store` puts N deterministic KV chunks, `retrieve` reads them back and checks bytes.

Run as a separate process per node (the test runs `store` against mount 1 and `retrieve` against mount 2):
    python mount_lmc_driver.py store|retrieve BASE_DIR N
Prints one JSON line with the counts.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

SHAPE = torch.Size([2, 4, 256, 128])  # K/V x layers x tokens x hidden: 1 MiB of float32 per chunk


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey(model_name="tiny", world_size=1, worker_id=0, chunk_hash=0x5EED0000 + i,
                          dtype=torch.float32)


def payload(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g, dtype=torch.float32)


def manager(base: str) -> StorageManager:
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True, max_local_cpu_size=0.2,
                                            remote_url=f"fs://localhost:0/{base}/", remote_serde="naive",
                                            lmcache_instance_id=f"drv-{os.getpid()}")
    md = LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.float32, kv_shape=(4, 2, 256, 2, 64))
    return StorageManager(cfg, md, EventManager())


def store(sm: StorageManager, base: str, n: int) -> dict:
    t0 = time.perf_counter()
    for i in range(n):
        obj = sm.allocate(SHAPE, torch.float32, MemoryFormat.KV_2LTD)
        assert obj is not None, "LMCache could not allocate a chunk"
        obj.tensor.copy_(payload(i).view(obj.tensor.shape))
        sm.batched_put([key(i)], [obj])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # RemoteBackend puts are asynchronous: wait for the files
        names = [f for f in os.listdir(base) if f.endswith(".data")]
        if len(names) >= n:
            break
        time.sleep(0.1)
    return {"stored": len(names), "put_s": round(time.perf_counter() - t0, 3),
            "tmp_left": len([f for f in os.listdir(base) if f.endswith(".tmp")])}


def retrieve(sm: StorageManager, n: int) -> dict:
    exact = wrong = missing = 0
    t0 = time.perf_counter()
    for i in range(n):
        obj = sm.get(key(i))
        if obj is None:
            missing += 1
            continue
        if torch.equal(obj.tensor.view(SHAPE), payload(i)):
            exact += 1
        else:
            wrong += 1
        obj.ref_count_down()
    return {"exact": exact, "wrong": wrong, "missing": missing, "get_s": round(time.perf_counter() - t0, 3)}


def main() -> None:
    mode, base, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sm = manager(base)
    try:
        out = store(sm, base, n) if mode == "store" else retrieve(sm, n)
        out["backends"] = list(sm.storage_backends)
    finally:
        sm.close()
    print(json.dumps(out), flush=True)
    os._exit(0)  # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    main()
