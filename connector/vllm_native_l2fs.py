"""An l2fs secondary tier for vLLM's native KV offloading (OffloadingConnector + TieringOffloadingSpec).

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":8589934592,
        "secondary_tiers":[{"type":"L2fsTier","module_path":"connector.vllm_native_l2fs",
                            "master":"l2fs-master:7070","node_id":"node-1"}]}}'

vLLM loads the class by `module_path` (SecondaryTierFactory); every other key is a constructor argument.

Why not vLLM's own `fs` tier on an l2fs FUSE mount: that tier pays one faccessat per key per lookup and an
open/read/close through FUSE per block. Here:
* lookups: vLLM's AsyncLookupManager batches a step's keys per request; each batch is ONE StatMany on the
  master (Client.stat_many), off the scheduler thread; a file of the wrong size is a miss;
* loads: one StatMany locates the job's blocks (Client.locate_many), then each block is read straight into
  its slot of the primary tier's memoryview (Client.get_into on a slice: no intermediate buffer), on a
  private thread pool; blocks that fail are reported as failed keys, the rest are kept;
* stores: one put_many per job (one AllocateMany + one CommitMany), each block put-if-absent from its
  primary slot (a memoryview slice, no copy), order hint = the block's position in its prompt;
* KV events (enable_kv_events, and vLLM's kv_events_config on): stored blocks as OffloadingEvent with
  medium STORAGE and this tier's locality (REMOTE by default: any replica reaches l2fs);
* stats: counters in vLLM's offloading stats (build_metric_definitions / get_stats, label `tier`).

Files use vLLM's own FileMapper layout under `prefix` (<prefix>/<model>_<config digest>_r<rank>/<hhh>/<hh>_g<group>/
<hash>.bin, raw block bytes), so vLLM's `fs` tier with root_dir=<mount><prefix> on an l2fs FUSE mount reads
and writes the same files (the benchmark compares them over the same bytes).

Key drift: at start-up vLLM's installed block hashing is checked against kvtier.contract (connector.keycheck,
hash_algorithm = vLLM's --prefix-caching-hash-algo); on a drift this tier stores nothing (jobs fail, vLLM
counts cascade failures) and logs "KVTIER KEY DRIFT". Any l2fs fault is a miss or a failed job, never an
exception into the scheduler.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from connector import keycheck
from connector.logs import ensure_log_handler

log = logging.getLogger("kvtier.connector.vllm_native_l2fs")
ensure_log_handler()

NATIVE_PREFIX = "/kvtier/native"
M_LOOKUPS = "kvtier:native_l2fs_lookup_keys"
M_HITS = "kvtier:native_l2fs_lookup_hits"
M_LOOKUP_RPCS = "kvtier:native_l2fs_lookup_rpcs"
M_LOAD_BYTES = "kvtier:native_l2fs_load_bytes"
M_LOAD_FAIL = "kvtier:native_l2fs_load_failed_blocks"
M_STORE_NEW = "kvtier:native_l2fs_store_published_blocks"
M_STORE_EXISTED = "kvtier:native_l2fs_store_existing_blocks"
M_STORE_FAIL = "kvtier:native_l2fs_store_failed_blocks"
M_DRIFT = "kvtier:native_l2fs_store_skipped_key_drift_blocks"
_METRICS = {M_LOOKUPS: "Keys looked up in l2fs", M_HITS: "Keys found in l2fs",
            M_LOOKUP_RPCS: "StatMany calls made for lookups (one per request batch)",
            M_LOAD_BYTES: "Bytes read from l2fs into primary-tier slots",
            M_LOAD_FAIL: "Blocks that failed to load (a miss, recomputed)",
            M_STORE_NEW: "Blocks this tier published in l2fs",
            M_STORE_EXISTED: "Blocks already in l2fs (put-if-absent, not rewritten)",
            M_STORE_FAIL: "Blocks that failed to store",
            M_DRIFT: "Blocks not stored because the installed vLLM's keys drift from kvtier.contract"}


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup state machine; each per-request batch is one StatMany."""

    def __init__(self, tier: L2fsTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._exist(keys)


class L2fsTier(SecondaryTierManager):
    """vLLM SecondaryTierManager over l2fs.Client (see the module doc)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 master: str | None = None, node_id: str | None = None, prefix: str = NATIVE_PREFIX,
                 timeout: float = 2.0, n_threads: int = 8, enable_kv_events: bool = False,
                 locality: str | None = "REMOTE", hash_algorithm: str = "sha256", token: str | None = None,
                 backpressure_detector: Any = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        from l2fs.client import Client
        from l2fs.options import ClientOptions

        opts = ClientOptions.from_mapping({"master": master, "node_id": node_id})  # config, else l2fs.envs
        master = opts.master
        if not master:
            raise ValueError("l2fs tier: set 'master' (host:port) in the tier config or $L2FS_MASTER")
        self.locality = Locality(locality) if locality is not None else None
        self.client = Client(master, node_id=opts.node_id,
                             timeout=timeout, token=token)
        self.prefix = prefix.rstrip("/") or NATIVE_PREFIX
        self.file_mapper = FileMapper.from_offloading_spec(root_dir=self.prefix, offloading_spec=offloading_spec,
                                                           blocks_per_file=offloading_spec.blocks_per_chunk,
                                                           parallel_agnostic=True)
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        self._bs = self.block_size_bytes
        groups = offloading_spec.config.groups
        self._tokens_per_chunk = max(1, groups[0].tokens_per_block * offloading_spec.blocks_per_chunk) if groups \
            else 1
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning("l2fs tier: enable_kv_events is set but vLLM's KV cache events are off: no events")
        block_tokens = groups[0].tokens_per_block if groups else 16
        self.key_check = keycheck.run("vllm_native_l2fs", keycheck.vllm_native, hash_algorithm,
                                      offloading_spec.tokens_per_hash or block_tokens)
        self._pool = ThreadPoolExecutor(max(1, int(n_threads)), thread_name_prefix="kvtier-native-l2fs")
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._stats: dict[str, float] = {}  # since the last get_stats (vLLM's stats interval)
        self.totals: dict[str, float] = {}  # since start (tests, benchmarks)
        self._closed = False
        self._pool.submit(self._write_run_config)
        self._lookups = _Lookups(self)
        log.info("kvtier l2fs native tier: master=%s prefix=%s block=%d B locality=%s", master,
                 self.file_mapper.base_path, self._bs, self.locality)

    # -- helpers ----------------------------------------------------------------------------------------
    def _count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._stats[name] = self._stats.get(name, 0) + n
            self.totals[name] = self.totals.get(name, 0) + n

    def _path(self, key: OffloadKey) -> str:
        return self.file_mapper.get_file_name(key)

    def _write_run_config(self) -> None:
        """The same config.json vLLM's fs tier writes, so either tier can read a directory the other wrote."""
        try:
            data = json.dumps(self.file_mapper.get_run_config(), indent=2, sort_keys=True).encode()
            self.client.put(self.file_mapper.get_config_file_path(), data, if_absent=True)
        except Exception as e:  # noqa: BLE001 - only informative
            log.warning("l2fs tier: could not write %s: %s", self.file_mapper.get_config_file_path(), e)

    def _exist(self, keys: list[OffloadKey]) -> list[bool]:
        """One StatMany for the batch; a file of another size than a block is a miss. A fault: all miss."""
        self._count(M_LOOKUPS, len(keys))
        try:
            self._count(M_LOOKUP_RPCS)
            stats = self.client.stat_many([self._path(k) for k in keys])
        except Exception as e:  # noqa: BLE001
            log.warning("l2fs tier: lookup of %d keys failed: %s", len(keys), e)
            return [False] * len(keys)
        found = [st is not None and not st.is_dir and st.size == self._bs for st in stats]
        self._count(M_HITS, sum(found))
        return found

    def _slot(self, chunk_id: int) -> memoryview:
        off = int(chunk_id) * self._bs
        return self._flat[off:off + self._bs]

    def _submit(self, fn: Any, *args: Any) -> None:
        with self._lock:
            self._inflight += 1
        self._pool.submit(self._run, fn, *args)

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - a job must always finish
            log.warning("l2fs tier: job failed: %s", e)
            result = JobResult(job_id=args[0].job_id, success=False)
        with self._lock:
            self._finished.append(result)
            self._inflight -= 1
            self._idle.notify_all()

    # -- store ------------------------------------------------------------------------------------------
    @staticmethod
    def _hint(req: ReqContext, key: OffloadKey, tokens_per_chunk: int) -> int:
        pos = req.get_offload_key_position(key)
        return max(0, (pos - 1) // tokens_per_chunk) if pos else 0

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store, job_metadata)

    def _store(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        if not self.key_check.writes_allowed:
            self._count(M_DRIFT, len(keys))
            return JobResult(job_id=job.job_id, success=False)
        t0 = time.perf_counter()
        items = [(self._path(k), self._slot(c)) for k, c in zip(keys, job.chunk_ids, strict=True)]
        hints = [self._hint(job.req_context, k, self._tokens_per_chunk) for k in keys]
        results = self.client.put_many(items, if_absent=True, order_hints=hints, return_exceptions=True)
        ok_keys = []
        for key, r in zip(keys, results, strict=True):
            if isinstance(r, BaseException):
                self._count(M_STORE_FAIL)
                log.warning("l2fs tier: store of one block failed: %s", r)
                continue
            self._count(M_STORE_NEW if r else M_STORE_EXISTED)
            ok_keys.append(key)
        if ok_keys and self.events is not None:
            with self._lock:
                self.events.append(OffloadingEvent(keys=ok_keys, medium=self.medium, removed=False,
                                                   locality=self.locality))
        return JobResult(job_id=job.job_id, success=len(ok_keys) == len(keys),
                         transfer_time=time.perf_counter() - t0, transfer_bytes=len(ok_keys) * self._bs)

    # -- load -------------------------------------------------------------------------------------------
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._load_keys[job_metadata.job_id] = list(job_metadata.keys)
        self._submit(self._load, job_metadata)

    def _load(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        paths = [self._path(k) for k in keys]
        t0 = time.perf_counter()
        if len(paths) > 1:
            self.client.locate_many(paths)  # one StatMany; the reads below skip their own Stat
        ok = []
        for key, path, cid in zip(keys, paths, job.chunk_ids, strict=True):
            try:
                n = self.client.get_into(path, self._slot(cid))  # straight into the primary slot
            except Exception as e:  # noqa: BLE001 - a fault is a miss
                log.warning("l2fs tier: load of %s failed: %s", path, e)
                n = None
            if n == self._bs:
                ok.append(key)
            else:
                self._count(M_LOAD_FAIL)
        self._count(M_LOAD_BYTES, len(ok) * self._bs)
        return JobResult(job_id=job.job_id, success=len(ok) == len(keys),
                         successful_keys=tuple(ok) if ok and len(ok) < len(keys) else None,
                         transfer_time=time.perf_counter() - t0, transfer_bytes=len(ok) * self._bs)

    # -- vLLM's tier interface ----------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        for r in done:
            keys = self._load_keys.pop(r.job_id, None)
            if keys is not None and not r.success:  # the failed blocks of a load: misses from now on
                kept = set(r.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in kept])
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._inflight > 0 or bool(self._finished)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        with self._lock:
            out, self.events = self.events, []
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        with self._lock:
            while self._inflight:
                self._idle.wait(0.1)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lookups.shutdown()
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self.client.close()
        if self._flat is not self._primary_kv_view:
            self._flat.release()  # our cast of the primary view: vLLM closes the mmap after us

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {name: OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))
                for name, doc in _METRICS.items()}

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        with self._lock:
            taken, self._stats = self._stats, {}
        if not taken:
            return None
        stats = OffloadingConnectorStats()
        for name, v in taken.items():
            stats.increase_counter(name, v, (self.tier_type,))
        return stats
