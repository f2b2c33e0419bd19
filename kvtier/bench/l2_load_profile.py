"""Step-by-step cost of one in-engine L2 load batch at kv8b geometry (32 MiB chunks), no engine (a benchmark).

What LMCache's `retrieve` does on a cross-pod L2 hit, taken apart and timed with perf_counter around the real
calls, in one run on the same bytes (chunks stored by node-1 through the plugin, read on node-2: data plane):

  raw get_into parallel   Client.get_into of every chunk on a pool as large as the plugin's, into buffers
                          allocated once (after one locate_many): the floor (bytes / this = the raw read)
  raw get_into seq        the same, one chunk after the other
  header parse            RemoteMetadata.deserialize of each header (from memory)
  L1 allocate             LocalCPUBackend.allocate of each chunk's MemoryObj (freed again)
  copy into MemoryObj     `dst[:] = np.frombuffer(buf...)` per chunk (from memory): the staging copy the plugin
                          made before it read full chunks straight into the MemoryObj (2026-12-05); kept as
                          the size of what that removed, and the cost a chunk of another geometry still pays
  plugin batched_get      L2fsConnector.batched_get on LMCache's loop (locate + parallel scatter get_into:
                          header into a small buffer, KV into the MemoryObj LMCache allocated)
  RemoteBackend blocking  RemoteBackend.batched_get_blocking (adds the instrumented wrapper, deserializer)
  StorageManager get      StorageManager.batched_get(location=RemoteBackend) (adds the L1 write-back submit)
  to paged KV             the CPU connector's batched_to_gpu of the batch into a vLLM-CPU-layout paged cache
  retrieve total          StorageManager get + to paged KV, what LMCache's `Retrieved ... throughput` covers
  retrieve pipelined      a prototype of overlapping the two (LMCache's retrieve does not): every chunk's
                          StorageManager get in flight at once, each written to the paged cache as it arrives

Prints raw ms per batch, GB/s and each step's ratio to the raw parallel read (median over --reps). The box is
shared: quote the ratios, which are measured side by side.

    .venv/bin/kvtier bench l2-load [--chunks 8] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from connector import keys as ckeys
from connector.config import lmcache_config
from kvtier.bench.chunk_read import _store
from l2fs.testing.cluster import LocalCluster

MODEL = "bench/kv8b"
LAYERS, HEADS, HEAD_DIM, CHUNK = 16, 8, 128, 256  # kvtier model kv8b: 128 KiB of fp32 KV per token
SHAPE = torch.Size([2, LAYERS, CHUNK, HEADS * HEAD_DIM])  # KV_2LTD: 32 MiB per chunk
PREFIX = "/kvtier/kv"
THREADS = 8  # the plugin's default pool


def _manager(master: str, node: str, l1_gb: float) -> StorageManager:
    d = lmcache_config(chunk_size=CHUNK, l1_gb=l1_gb, l2fs_master=master, node_id=node, prefix=PREFIX,
                       l2_timeout=10.0, extra={"remote_storage_plugin.l2fs.threads": THREADS,
                                               "remote_storage_plugin.l2fs.precheck_share": 0})
    d.pop("remote_serde")
    md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.float32, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM))
    return StorageManager(LMCacheEngineConfig.from_defaults(**d), md, EventManager())


def _remote_name(sm: StorageManager) -> str:
    return next(n for n in sm.storage_backends if n.startswith("RemoteBackend"))


def _key(h: int) -> CacheEngineKey:
    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=h, dtype=torch.float32)


def _interleaved(arms: list[tuple[str, Callable[[], Any]]], reps: int) -> list[tuple[str, float, float]]:
    """Median wall and CPU seconds (this process, all threads) of each arm; the arms take turns within each
    rep, so a load spike on the shared box hits all of them alike (the ratios are side by side). The CPU
    time of the in-process steps is what they cost even when other processes take the cores away."""
    for _, fn in arms:
        fn()  # warm-up (connections, page cache, first-touch of buffers)
    ts: list[list[float]] = [[] for _ in arms]
    cs: list[list[float]] = [[] for _ in arms]
    for _ in range(reps):
        for i, (_, fn) in enumerate(arms):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t0)
            cs[i].append(time.process_time() - c0)
    return [(name, statistics.median(t), statistics.median(c)) for (name, _), t, c in zip(arms, ts, cs, strict=True)]


def _paged_kv(n_tokens: int) -> tuple[Any, list[torch.Tensor], torch.Tensor, str]:
    """The CPU connector with a vLLM-CPU-layout cache big enough for the batch (block layout from vLLM's
    own kernel when vLLM imports, else an identity layout: the copy cost is the same index_copy_)."""
    from connector.cpu_kv_connector import CPUPagedKVConnector, affine_strides, probe_block_layout

    bs = 128  # vLLM's CPU default block size
    conn = CPUPagedKVConnector(LAYERS, HEADS, HEAD_DIM, torch.float32)
    try:
        conn._offsets, how = probe_block_layout(HEADS, bs, HEAD_DIM, torch.float32), "vLLM's kernel layout"
    except Exception:  # noqa: BLE001 - no vLLM kernels here: same copy volume, plain layout
        conn._offsets = torch.arange(2 * HEADS * bs * HEAD_DIM).view(2, HEADS, bs, HEAD_DIM)
        how = "identity layout (vLLM kernels not importable)"
    conn._strides = affine_strides(conn._offsets)
    conn._block_size = bs
    blocks = n_tokens // bs + 1
    caches = [torch.zeros(blocks, HEADS, bs, 2 * HEAD_DIM) for _ in range(LAYERS)]
    order = torch.randperm(blocks)[:n_tokens // bs]  # vLLM's paged slot mapping: whole blocks, any order
    slots = (order[:, None] * bs + torch.arange(bs)).reshape(-1)
    return conn, caches, slots, how


def run(chunks: int, reps: int) -> list[dict]:
    keys = [_key(5000 + i) for i in range(chunks)]
    paths = [ckeys.key_path(PREFIX, k) for k in keys]
    l1_gb = max(1.0, 4 * chunks * SHAPE.numel() * 4 / 2**30)
    with tempfile.TemporaryDirectory(prefix="kvtier-l2-load-") as d, LocalCluster(Path(d), workers=2) as cluster:
        _store(cluster, keys, lambda m, n: _manager(m, n, l1_gb), SHAPE)  # node-1 stores them
        client = cluster.client(node_id="node-2")
        sm = _manager(cluster.master, "node-2", l1_gb)
        pool = ThreadPoolExecutor(THREADS)
        try:
            stats = client.stat_many(paths)
            assert all(s is not None and s.nodes == ["node-1"] for s in stats), "chunks must be on node-1"
            size = stats[0].size
            bufs = [bytearray(size) for _ in keys]
            remote = sm.storage_backends[_remote_name(sm)]
            conn = remote.connection._connector
            lcb = conn.local_cpu_backend
            hdr = conn.remote_metadata_bytes

            def raw_par() -> None:
                client.locate_many(paths)
                got = list(pool.map(lambda i: client.get_into(paths[i], bufs[i]), range(chunks)))
                assert all(g == size for g in got), got

            def raw_seq() -> None:
                client.locate_many(paths)
                for p, b in zip(paths, bufs, strict=True):
                    assert client.get_into(p, b) == size

            arms: list[tuple[str, Callable[[], Any]]] = [("raw get_into parallel", raw_par), ("raw get_into seq", raw_seq)]
            raw_par()  # the buffers hold the chunks from here on (the in-memory steps read them)
            mds = [RemoteMetadata.deserialize(bytes(b[:hdr])) for b in bufs]
            arms.append(("header parse", lambda: [RemoteMetadata.deserialize(bytes(b[:hdr])) for b in bufs]))

            def alloc() -> None:
                for o in [lcb.allocate(m.shapes, m.dtypes, m.fmt) for m in mds]:
                    o.ref_count_down()

            arms.append(("L1 allocate", alloc))
            objs = [lcb.allocate(m.shapes, m.dtypes, m.fmt) for m in mds]

            def copy(par: bool) -> Callable[[], None]:
                def one(i: int) -> None:
                    dst = np.frombuffer(objs[i].byte_array, dtype=np.uint8)
                    dst[:] = np.frombuffer(bufs[i], dtype=np.uint8, count=mds[i].length, offset=hdr)
                return (lambda: list(pool.map(one, range(chunks)))) if par else (
                    lambda: [one(i) for i in range(chunks)])

            arms.append(("copy into MemoryObj, seq", copy(False)))
            arms.append(("copy into MemoryObj, parallel", copy(True)))

            def release(got: list) -> None:
                assert all(o is not None for o in got), "a chunk missed"
                for o in got:
                    o.ref_count_down()

            arms.append(("plugin batched_get", lambda: release(asyncio.run_coroutine_threadsafe(
                conn.batched_get(keys), conn.loop).result(60))))
            arms.append(("RemoteBackend batched_get_blocking",
                         lambda: release(remote.batched_get_blocking(keys))))
            name = _remote_name(sm)
            arms.append(("StorageManager batched_get", lambda: release(sm.batched_get(keys, location=name))))
            pconn, caches, slots, how = _paged_kv(chunks * CHUNK)
            starts = [i * CHUNK for i in range(chunks)]
            ends = [s + CHUNK for s in starts]
            arms.append(("to paged KV, per element (before)", lambda: pconn.batched_to_gpu(
                objs, starts, ends, kvcaches=caches, slot_mapping=slots.flip(0))))  # not whole blocks
            arms.append((f"to paged KV (CPU connector, {how})", lambda: pconn.batched_to_gpu(
                objs, starts, ends, kvcaches=caches, slot_mapping=slots)))

            def retrieve() -> None:
                got = sm.batched_get(keys, location=name)
                pconn.batched_to_gpu(got, starts, ends, kvcaches=caches, slot_mapping=slots)
                release(got)

            arms.append(("retrieve total (SM get + to paged KV)", retrieve))
            fetch = ThreadPoolExecutor(chunks)

            def retrieve_pipelined() -> None:
                # a prototype of the upstream change (docs/results/2026-12-01-l2-load-profile.md, "Structure"):
                # every chunk's get in flight at once, each written into the paged cache as soon as it arrives
                futs = [fetch.submit(sm.batched_get, [k], location=name) for k in keys]
                for i, f in enumerate(futs):
                    got = f.result(60)
                    pconn.batched_to_gpu(got, starts[i:i + 1], ends[i:i + 1], kvcaches=caches, slot_mapping=slots)
                    release(got)

            arms.append(("retrieve pipelined (per-chunk to paged KV)", retrieve_pipelined))
            written = []
            for fn in (retrieve, retrieve_pipelined):  # both must write the same cache, byte for byte
                for c in caches:
                    c.zero_()
                fn()
                written.append([c.clone() for c in caches])
            assert all(torch.equal(a, b) for a, b in zip(*written, strict=True)), "pipelined retrieve wrote other KV"
            assert any(bool(c.any()) for c in written[0]), "retrieve wrote nothing"
            rows = _interleaved(arms, reps)
            for o in objs:
                o.ref_count_down()
            fetch.shutdown()
        finally:
            pool.shutdown()
            sm.close()
            client.close()
    nbytes = chunks * SHAPE.numel() * 4
    floor = rows[0][1]
    out = [{"step": s, "ms": t * 1e3, "cpu_ms": c * 1e3, "gbps": nbytes / t / 1e9, "x_floor_time": t / floor}
           for s, t, c in rows]
    print(f"\n{chunks} chunks x {size} bytes ({nbytes / 1e6:.0f} MB of KV, kv8b geometry) stored by node-1, read "
          f"on node-2 (data plane); median of {reps}; pool {THREADS} threads")
    print(f"{'step':>52} | {'ms/batch':>9} | {'CPU ms':>7} | {'GB/s':>6} | {'time / raw':>10} | {'rate / raw':>10}")
    for r in out:
        print(f"{r['step']:>52} | {r['ms']:9.1f} | {r['cpu_ms']:7.1f} | {r['gbps']:6.2f} | {r['x_floor_time']:9.2f}x | "
              f"{1 / r['x_floor_time']:9.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench l2-load", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=8, help="chunks per batch (8 = 2,048 tokens, 256 MiB)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    out = run(a.chunks, a.reps)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
