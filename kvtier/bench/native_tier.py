"""`kvtier bench native-tier`: vLLM native offloading's secondary tiers side by side over the same bytes.

Arms (each a real vLLM TieringOffloadingSpec with a CPU primary tier and ONE secondary tier, built by vLLM's
SecondaryTierFactory from its config dict, the same as OffloadingConnector does in an engine):

  l2fs tier        connector.vllm_native_l2fs.L2fsTier (module_path), l2fs master + 2 workers on this machine
  fs on l2fs mount vLLM's `fs` tier, root_dir on an `l2fs mount` of the same cluster (FUSE), one per node
  fs on local dir  vLLM's `fs` tier, root_dir on a local directory (page cache: the floor)

Per arm: a writer engine on node-1 stores N blocks (GPU->primary emulated by filling primary slots, then
vLLM's cascade to the tier); a second engine on node-2 (its own l2fs client / its own mount) with an empty
primary tier then
  lookups/s  the tier's batch lookup of the N keys, as vLLM's AsyncLookupManager worker calls it: one
             StatMany for l2fs, one faccessat per key for `fs`; the first (cold) batch, and the median of
             --reps as "warm" (a mount's kernel cache then answers; vLLM caches verdicts itself anyway);
  load GB/s  one promotion job of the N blocks into primary slots (submit_load -> get_finished_jobs),
             median of --reps, and the loaded bytes are compared with what was stored.
Raw numbers, then each arm's ratio to `fs on local dir`. A machine without /dev/fuse (or not root) skips the
mount arm and says so. A GPU is not used: these tiers move bytes between storage and host memory only
(the GPU<->primary copy is vLLM's CPUOffloadingWorker, the same for every arm; `kvtier bench gpu-path` and
benchmarks/gpu/native_tier.sh cover the GPU side).

    .venv/bin/kvtier bench native-tier [--blocks 64] [--block-kib 2048] [--reps 5] [--json out.json]
    .venv/bin/kvtier bench native-tier --quick      # what CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import contract

TOKENS_PER_BLOCK = 16
ARMS = ("l2fs tier", "fs on l2fs mount", "fs on local dir")


def offloading_config(engine_id: str, block_bytes: int, tiers: list[dict[str, Any]], *, num_blocks: int,
                      model: str = "org/tiny", events: bool = True) -> Any:
    """vLLM's normalized OffloadingConfig for one single-rank engine with `tiers` as secondary tiers."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": block_bytes * (num_blocks + 4), "secondary_tiers": tiers},
        engine_id=engine_id, model=OffloadingModelConfig(name=model, dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


class Engine:
    """The scheduler side of one engine's native offloading: vLLM's TieringOffloadingSpec + manager."""

    def __init__(self, block_bytes: int, tiers: list[dict[str, Any]], num_blocks: int, model: str = "org/tiny"):
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.engine_id = f"kvtier-bench-{uuid.uuid4().hex[:12]}"
        self.spec = TieringOffloadingSpec(offloading_config(self.engine_id, block_bytes, tiers,
                                                            num_blocks=num_blocks, model=model))
        self.manager = self.spec.get_manager()
        view = self.manager.primary_tier.get_kv_memoryview()  # (num_chunks, row bytes), the tiers' view
        self.block_bytes = view.strides[0]
        self.flat = view.cast("B")
        self.tier = self.manager.secondary_tiers[0]

    def slot(self, chunk_id: int) -> memoryview:
        return self.flat[int(chunk_id) * self.block_bytes:(int(chunk_id) + 1) * self.block_bytes]

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        while self.manager.has_pending_work():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("offloading jobs did not finish")
            self.step()
            time.sleep(0.002)
        self.step()

    def store(self, req_id: str, keys: list[bytes], payload: list[bytes]) -> None:
        """What the GPU->CPU offload does (bytes into primary slots), then vLLM's cascade to the tier."""
        from vllm.v1.kv_offload.base import ReqContext

        req = ReqContext(req_id=req_id)
        for i, k in enumerate(keys):
            req.set_offload_key_position(k, (i + 1) * TOKENS_PER_BLOCK)
        self.manager.on_new_request(req)
        out = self.manager.prepare_store(keys, req)
        assert out is not None, "primary tier full"
        for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.slot(cid)[:] = payload[keys.index(k)]
        self.manager.complete_store(out.keys_to_store, req)
        self.manager.on_request_finished(req)
        self.settle()

    def fetch(self, req_id: str, keys: list[bytes], timeout: float = 60.0) -> list[bytes | None]:
        """What the scheduler does for a new prompt: lookups until every key resolves, promotions, then the
        bytes of each HIT key's primary slot (None = miss)."""
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        req = ReqContext(req_id=req_id)
        self.manager.on_new_request(req)
        t0 = time.monotonic()
        while True:
            res = [self.manager.lookup(k, req) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                break
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"lookups never resolved: {res}")
            self.step()
            time.sleep(0.002)
        hits = [k for k, r in zip(keys, res, strict=True) if r is LookupResult.HIT]
        out: list[bytes | None] = [None] * len(keys)
        if hits:
            spec = self.manager.prepare_load(hits, req)
            for k, cid in zip(hits, spec.chunk_ids, strict=True):
                out[keys.index(k)] = bytes(self.slot(cid))
            self.manager.complete_load(hits, req)
        self.manager.on_request_finished(req)
        self.step()
        return out

    def close(self) -> None:
        self.flat.release()
        self.manager.shutdown()


def block_keys(tokens: list[int], group: int = 0) -> list[bytes]:
    """vLLM OffloadKeys of the full blocks of `tokens` (its default sha256 block hashes)."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(h, group) for h in contract.vllm_block_hashes(tokens, TOKENS_PER_BLOCK)]


def l2fs_tier(master: str, node_id: str, **kw: Any) -> dict[str, Any]:
    return {"type": "L2fsTier", "module_path": "connector.vllm_native_l2fs", "master": master,
            "node_id": node_id, **kw}


def fs_tier(root: str | os.PathLike[str]) -> dict[str, Any]:
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 8, "n_write_threads": 8}


def _measure(engine_w: Engine, engine_r: Engine, keys: list[bytes], payload: list[bytes], reps: int
             ) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    engine_w.store("w", keys, payload)
    tier = engine_r.tier
    lk = getattr(tier, "_lookup_manager", None) or tier._lookups  # vLLM's fs tier | ours
    req = ReqContext(req_id="bench")
    lookup_s = []
    for _ in range(reps):
        t0 = time.perf_counter()
        found = list(lk.batch_lookup(keys, req))
        lookup_s.append(time.perf_counter() - t0)
        assert all(found), f"{sum(found)}/{len(found)} keys found"
    chunk_ids = np.arange(len(keys), dtype=np.int64)
    load_s, ok = [], True
    zero = bytes(engine_r.block_bytes)
    for rep in range(reps):
        for i in range(len(keys)):  # every rep must bring the bytes back itself
            engine_r.slot(i)[:] = zero
        job = TransferJob(job_id=10_000 + rep, keys=keys, chunk_ids=chunk_ids, is_promotion=True,
                          req_context=req)
        t0 = time.perf_counter()
        tier.submit_load(job)
        done: list[Any] = []
        while not done:
            done = [r for r in tier.get_finished_jobs() if r.job_id == job.job_id]
            if not done:
                time.sleep(0.0002)
        load_s.append(time.perf_counter() - t0)
        ok = ok and done[0].success and all(bytes(engine_r.slot(i)) == payload[i] for i in range(len(keys)))
    n, nbytes = len(keys), len(keys) * engine_r.block_bytes
    lk_med, ld_med = statistics.median(lookup_s), statistics.median(load_s)
    # the first batch is the cold one (a new prompt on this replica: its mount's kernel cache knows nothing yet);
    # later reps of the same keys are warm (FUSE dentry/attr cache), which vLLM's own lookup cache makes moot
    return {"lookups_per_s": n / lookup_s[0], "lookup_ms": lookup_s[0] * 1e3,
            "warm_lookups_per_s": n / lk_med, "load_gbps": nbytes / ld_med / 1e9,
            "load_ms": ld_med * 1e3, "bytes_ok": ok, "raw_lookup_s": lookup_s, "raw_load_s": load_s}


def _fuse_ok() -> str | None:
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        return "no /dev/fuse or fusermount3"
    if os.geteuid() != 0:
        return "not root"
    return None


def run(blocks: int, block_bytes: int, reps: int, base: Path) -> dict[str, Any]:
    from l2fs import fuse
    from l2fs.testing.cluster import LocalCluster

    rng = np.random.default_rng(7)
    payload = [rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes() for _ in range(blocks)]
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    cap = f"{max(2, 4 * blocks * block_bytes >> 30)}G"
    with LocalCluster(base / "cluster", workers=2, capacity=cap) as c:
        # (arm, writer's tier on node-1, reader's tier on node-2): the reader is another replica, as in a
        # cross-pod hit; each node has its own mount, so the reader's kernel has cached nothing of the writer's
        arms = [("l2fs tier", l2fs_tier(c.master, "node-1"), l2fs_tier(c.master, "node-2"))]
        mounts: list[tuple[Any, Path]] = []
        why = _fuse_ok()
        try:
            if why is None:
                for node in ("node-1", "node-2"):
                    mp = base / f"mnt-{node}"
                    mounts.append((fuse.spawn(mp, c.master, "--node-id", node, log=base / f"mount-{node}.log"), mp))
                arms.append(("fs on l2fs mount", fs_tier(mounts[0][1] / "kvtier-fs"),
                             fs_tier(mounts[1][1] / "kvtier-fs")))
            else:
                skipped["fs on l2fs mount"] = why
            (base / "local").mkdir(exist_ok=True)
            arms.append(("fs on local dir", fs_tier(base / "local"), fs_tier(base / "local")))
            for i, (name, wtier, rtier) in enumerate(arms):
                toks = [(i * 1_000_003 + j * 7919) % 50257 for j in range(blocks * TOKENS_PER_BLOCK)]
                keys = block_keys(toks)
                w = Engine(block_bytes, [wtier], blocks)
                r = Engine(block_bytes, [rtier], blocks)
                try:
                    results[name] = _measure(w, r, keys, payload, reps)
                finally:
                    w.close()
                    r.close()
        finally:
            for proc, mp in mounts:
                fuse.stop(proc, mp)
    floor = results["fs on local dir"]
    for res in results.values():
        res["lookups_vs_local"] = res["lookups_per_s"] / floor["lookups_per_s"]
        res["load_vs_local"] = res["load_gbps"] / floor["load_gbps"]
    if "fs on l2fs mount" in results:
        m = results["fs on l2fs mount"]
        for res in results.values():
            res["lookups_vs_mount"] = res["lookups_per_s"] / m["lookups_per_s"]
            res["load_vs_mount"] = res["load_gbps"] / m["load_gbps"]
    return {"blocks": blocks, "block_bytes": block_bytes, "reps": reps, "arms": results, "skipped": skipped}


def table(res: dict[str, Any]) -> str:
    lines = ["| arm | lookups/s (cold) | lookup ms | warm lookups/s | load GB/s | load ms | lookups vs local | load vs local | "
             "lookups vs mount | load vs mount | bytes ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ARMS:
        if name not in res["arms"]:
            lines.append(f"| {name} | skipped: {res['skipped'].get(name, '?')} |  |  |  |  |  |  |  |  |  |")
            continue
        a = res["arms"][name]
        vm = (f"{a['lookups_vs_mount']:.2f}x", f"{a['load_vs_mount']:.2f}x") if "lookups_vs_mount" in a \
            else ("-", "-")
        lines.append(f"| {name} | {a['lookups_per_s']:,.0f} | {a['lookup_ms']:.2f} | "
                     f"{a['warm_lookups_per_s']:,.0f} | {a['load_gbps']:.3f} | "
                     f"{a['load_ms']:.1f} | {a['lookups_vs_local']:.2f}x | {a['load_vs_local']:.2f}x | "
                     f"{vm[0]} | {vm[1]} | {a['bytes_ok']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench native-tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=64, help="blocks per arm (one lookup batch, one load job)")
    p.add_argument("--block-kib", type=int, default=2048, help="block size in KiB (2 MiB ~ 16 tokens of an 8B)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="16 blocks of 256 KiB, 3 reps (CI)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.quick:
        a.blocks, a.block_kib, a.reps = 16, 256, 3
    base = Path(a.dir or tempfile.mkdtemp(prefix="native-tier-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        res = run(a.blocks, a.block_kib << 10, a.reps, base)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(f"vLLM native offloading tiers: {a.blocks} blocks x {a.block_kib} KiB, median of {a.reps}; "
          "one lookup batch and one load job of all blocks per rep")
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if all(x["bytes_ok"] for x in res["arms"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
