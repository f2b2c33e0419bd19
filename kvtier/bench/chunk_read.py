"""Per-chunk cost of the in-engine L2 read (l2fs -> LMCache MemoryObj), outside vLLM (a benchmark, not a test).

What the cross-pod replica B does on an L2 hit: fetch N prompt chunks (~1 MiB each, LMCache fs-connector
format) that replica A stored on another node's worker. Arms, same bytes, same run, one batch = N chunks:

  local file readinto   the block files read straight from the worker's disk (page cache): physical floor
  get_into seq          Client.get_into per chunk, one after the other, fresh buffer each (a master Stat each)
  get_into seq located  the same after one Client.locate_many for the batch (no Stat per chunk)
  plugin gets, Stat each  the plugin's get() per chunk, gathered (what batched_get did before locate_many)
  plugin batched_get    LMCache's RemoteBackend.batched_get_blocking -> L2fsConnector.batched_get, i.e. the
                        whole in-engine path (locations, data plane, CRC, header checks, MemoryObj)

Prints a table of raw numbers (median over --reps batches): ms per batch, ms per chunk, GB/s, and each arm's
ratio to the local-file floor.

    .venv/bin/kvtier bench chunk-read [--chunks 31] [--reps 15] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from connector import keys as ckeys
from connector.config import lmcache_config
from l2fs.testing.cluster import LocalCluster

MODEL = "bench/tiny"
SHAPE = torch.Size([2, 4, 256, 128])  # one 256-token chunk of the tiny Llama: 1 MiB of fp32 KV
PREFIX = "/kvtier/kv"


def _manager(master: str, node: str, threads: int = 8) -> StorageManager:
    d = lmcache_config(chunk_size=256, l1_gb=0.5, l2fs_master=master, node_id=node, prefix=PREFIX, l2_timeout=2.0,
                       extra={"remote_storage_plugin.l2fs.threads": threads})
    d.pop("remote_serde")
    md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.float32, kv_shape=(4, 2, 256, 2, 64))
    return StorageManager(LMCacheEngineConfig.from_defaults(**d), md, EventManager())


def _remote(sm: StorageManager):
    return next(b for n, b in sm.storage_backends.items() if n.startswith("RemoteBackend"))


def _key(h: int) -> CacheEngineKey:
    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=h, dtype=torch.float32)


def _store(cluster: LocalCluster, keys: list[CacheEngineKey],
           make: Callable[[str, str], StorageManager] = _manager, shape: torch.Size = SHAPE) -> None:
    """Replica A (node-1) stores the chunks through the plugin, then waits until l2fs has them all."""
    a = make(cluster.master, "node-1")
    try:
        objs = []
        for i, _ in enumerate(keys):
            obj = a.allocate(shape, torch.float32, MemoryFormat.KV_2LTD)
            obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(i)))
            objs.append(obj)
        a.batched_put(keys, objs)
        c = cluster.client()
        try:
            paths = [ckeys.key_path(PREFIX, k) for k in keys]
            t0 = time.monotonic()
            while c.prefix_lookup(paths) < len(paths):
                if time.monotonic() - t0 > 60:
                    raise RuntimeError("chunks not stored")
                time.sleep(0.1)
        finally:
            c.close()
    finally:
        a.close()


def _time(fn: Callable[[], int], reps: int) -> tuple[float, int]:
    fn()  # warm-up (connections, page cache)
    ts = []
    n = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        n = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), n


def run(chunks: int, reps: int, threads: list[int]) -> None:
    keys = [_key(1000 + i) for i in range(chunks)]
    paths = [ckeys.key_path(PREFIX, k) for k in keys]
    with tempfile.TemporaryDirectory(prefix="kvtier-chunk-bench-") as d, LocalCluster(Path(d), workers=2) as cluster:
        _store(cluster, keys)
        client = cluster.client(node_id="node-2")  # replica B's node: every block is on node-1 -> data plane
        sms = {t: _manager(cluster.master, "node-2", t) for t in threads}
        try:
            stats = client.stat_many(paths)
            assert all(s is not None and s.nodes == ["node-1"] for s in stats), "chunks must be on node-1"
            size = stats[0].size
            files = sorted((f for f in cluster.workers[0].data_dir.rglob("*") if f.is_file()
                            and f.stat().st_size == size), key=str)[:chunks]
            buf = bytearray(size)

            def local() -> int:
                n = 0
                for f in files:
                    with open(f, "rb", buffering=0) as fh:
                        n += fh.readinto(buf)
                return n

            def seq() -> int:
                return sum(client.get_into(p, bytearray(size)) or 0 for p in paths)

            def seq_located() -> int:
                client.locate_many(paths)
                return seq()

            arms: list[tuple[str, Callable[[], int]]] = [("local file readinto", local),
                                                         ("get_into seq, Stat each", seq)]
            if hasattr(client, "locate_many"):  # absent on trees before it (to compare old and new code)
                arms.append(("get_into seq, located", seq_located))
            for t, sm in sms.items():
                backend = _remote(sm)
                conn = _conn(sm)

                def stat_each(conn=conn) -> int:  # the old batched_get: gather get() per key, a Stat each
                    async def gather() -> list:
                        return list(await asyncio.gather(*(conn.get(k) for k in keys)))

                    return _sizes(asyncio.run_coroutine_threadsafe(gather(), conn.loop).result(30))

                arms.append((f"plugin get each, {t} thr", stat_each))
                arms.append((f"plugin batched_get, {t} thr", lambda backend=backend: _sizes(
                    backend.batched_get_blocking(keys))))
            res = [(name, *_time(fn, reps)) for name, fn in arms]
            body = size - _conn(sms[threads[0]]).remote_metadata_bytes
        finally:
            for sm in sms.values():
                sm.close()
            client.close()
    floor = res[0][1]
    print(f"\n{chunks} chunks of {size} bytes ({size * chunks / 1e6:.1f} MB) stored by node-1, read on node-2 "
          f"(cross-node: data plane); median of {reps} batches")
    hdr = ("arm", "ms/batch", "ms/chunk", "GB/s", "x floor", "all bytes")
    print(" | ".join(f"{h:>26}" for h in hdr))
    for name, med, n in res:
        vals = (name, f"{med * 1e3:.1f}", f"{med * 1e3 / chunks:.2f}", f"{n / med / 1e9:.2f}", f"{med / floor:.1f}x",
                "yes" if n >= chunks * body else "NO")
        print(" | ".join(f"{v:>26}" for v in vals))


def _sizes(objs: list) -> int:
    """Bytes of the MemoryObjs returned; each is released (as the engine would after copying to vLLM)."""
    n = 0
    for o in objs:
        if o is not None:
            n += o.get_size()
            o.ref_count_down()
    return n


def _conn(sm: StorageManager):
    return _remote(sm).connection._connector


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench chunk-read", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=31)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", default="8", help="plugin thread pool sizes to compare (default: the plugin's 8)")
    a = p.parse_args(argv)
    run(a.chunks, a.reps, [int(t) for t in a.threads.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
