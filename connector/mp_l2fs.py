"""LMCache MP-mode L2 adapter over l2fs (the `lmcache server` side of the multiprocess mode).

    lmcache server --l1-size-gb 4 --chunk-size 256 --l2-adapter \
      '{"type":"plugin","module_path":"connector.mp_l2fs","class_name":"L2fsL2Adapter",
        "adapter_params":{"master":"127.0.0.1:7070","node_id":"node-1"}}'

Contract (LMCache's L2AdapterInterface): non-blocking submit_* calls, three distinct event fds signalled on
completion, results popped/queried exactly once, lookup answers a bitmap, load copies into caller-owned
buffers, close() is idempotent. Files hold the raw object bytes (like LMCache's fs L2 adapter) under
reversible names (connector.keys). Lookups are one StatMany RPC per batch. Any l2fs fault is a miss or a
failed store (-1), never an exception to the caller. Stores pass each chunk's index in its prompt as l2fs
order hint (connector.positions: recorded where the server hashes a session's tokens), so l2fs evicts the
deepest chunks of a prefix chain first.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from connector import keycheck, positions
from connector import keys as ckeys
from connector.loadgate import LoadGate
from connector.logs import ensure_log_handler
from kvtier import contract
from kvtier import envs as kvtier_envs

log = logging.getLogger("kvtier.connector.mp_l2fs")
ensure_log_handler()


class L2fsL2AdapterConfig(L2AdapterConfigBase):
    """adapter_params: master (or $L2FS_MASTER), node_id, prefix (/kvtier/mp), timeout (s), threads, and
    model_revision + namespace: objects then live under <prefix>/<namespace>/<model_revision>, so servers of
    different weights never share them (kvtier.contract.revision_prefix). prefill_tokens_per_s (or
    $KVTIER_PREFILL_TOKENS_PER_S), load_margin, rate_probe_interval, chunk_size: lookups find nothing while
    loading would be slower than recomputing (connector.loadgate; unset prefill rate = off). hash_algorithm:
    the server's --hash-algorithm (LMCache's default blake3), whose keys are checked against kvtier.contract
    at start-up (connector.keycheck: on a drift the adapter stores nothing)."""

    def __init__(self, master: str, node_id: str = "", prefix: str = contract.MP_PREFIX, timeout: float = 2.0,
                 threads: int = 8, prefill_tokens_per_s: float = 0.0, load_margin: float = 1.0,
                 rate_probe_interval: float = 5.0, chunk_size: int = contract.CHUNK_SIZE,
                 hash_algorithm: str = "blake3") -> None:
        self.master, self.node_id, self.prefix = master, node_id, prefix.rstrip("/") or contract.MP_PREFIX
        self.timeout, self.threads = timeout, threads
        self.prefill_tokens_per_s, self.load_margin = prefill_tokens_per_s, load_margin
        self.rate_probe_interval, self.chunk_size = rate_probe_interval, chunk_size
        self.hash_algorithm = hash_algorithm

    @classmethod
    def from_dict(cls, d: dict) -> L2fsL2AdapterConfig:
        from l2fs.options import ClientOptions

        opts = ClientOptions.from_mapping(d)  # l2fs's shared client options: master, node id (config, else env)
        master = opts.master
        if not isinstance(master, str) or not master:
            raise ValueError("l2fs L2 adapter: adapter_params.master (host:port) or $L2FS_MASTER is required")
        timeout = float(d.get("timeout", 2.0))
        threads = int(d.get("threads", 8))
        if timeout <= 0 or threads <= 0:
            raise ValueError("l2fs L2 adapter: timeout and threads must be positive")
        prefix = contract.revision_prefix(str(d.get("prefix", contract.MP_PREFIX)), str(d.get("namespace") or ""),
                                          str(d.get("model_revision") or ""))
        prefill = float(d.get("prefill_tokens_per_s") or kvtier_envs.get("KVTIER_PREFILL_TOKENS_PER_S") or 0)
        return cls(master, opts.node_id, prefix, timeout, threads,
                   prefill, float(d.get("load_margin", 1.0)), float(d.get("rate_probe_interval", 5.0)),
                   int(d.get("chunk_size", contract.CHUNK_SIZE)), str(d.get("hash_algorithm") or "blake3"))

    @classmethod
    def help(cls) -> str:
        return cls.__doc__ or ""


def _bytes(obj: Any) -> np.ndarray:
    """A writable uint8 view of a MemoryObj's bytes (byte_array may use format '<B')."""
    return np.frombuffer(obj.byte_array, dtype=np.uint8)


class L2fsL2Adapter(L2AdapterInterface):
    """L2AdapterInterface over l2fs.Client; work runs on a private thread pool."""

    config_class_name = "L2fsL2AdapterConfig"

    def __init__(self, config: L2fsL2AdapterConfig | dict, l1_memory_desc: Any = None) -> None:
        super().__init__()
        from l2fs.client import Client

        if isinstance(config, dict):
            config = L2fsL2AdapterConfig.from_dict(config)
        self.cfg = config
        self.client = Client(config.master, node_id=config.node_id, timeout=config.timeout)
        self.key_check = keycheck.run("mp_l2fs", keycheck.lmcache_mp, config.hash_algorithm, config.chunk_size)
        positions.install_mp()  # ObjectKey.chunk_hash -> index in the prompt, for the order hints of stores
        # bytes per token is learnt from the first loaded object (object bytes / chunk tokens); 0 = gate off
        self.gate = LoadGate(0, config.prefill_tokens_per_s, margin=config.load_margin,
                             probe_interval=config.rate_probe_interval, stall_s=config.timeout / 2)
        self._object_bytes = 0
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="kvtier-mp-l2fs")
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._closed = False

    # -- fds / ids --------------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    def _task(self) -> L2TaskId:
        with self._lock:
            tid = self._next
            self._next += 1
            return tid

    def _path(self, key: Any) -> str:
        return ckeys.object_key_path(self.cfg.prefix, key)

    # -- store ------------------------------------------------------------------------------------------
    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        tid = self._task()
        self._pool.submit(self._store, tid, list(keys), list(objects))
        return tid

    def _store(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        ok, total, new_keys, sizes = True, 0, [], []
        if not self.key_check.writes_allowed:  # keys nobody could find: store nothing (logged at start-up)
            with self._lock:
                self._stores[tid] = L2StoreResult(False, 0)
            self._store_efd.notify()
            return
        try:
            datas = [memoryview(_bytes(obj)) for obj in objects]
            # one put_many for the task (one AllocateMany + one CommitMany); a failed chunk fails the task's
            # result but not its neighbours, which are published and announced
            results = self.client.put_many([(self._path(k), d) for k, d in zip(keys, datas, strict=True)],
                                           if_absent=True, return_exceptions=True,
                                           order_hints=positions.INDEX.hints(k.chunk_hash for k in keys))
            for key, data, r in zip(keys, datas, results, strict=True):
                if isinstance(r, BaseException):
                    log.warning("kvtier MP l2fs store of one chunk failed: %s", r)
                    ok = False
                    continue
                if r:
                    new_keys.append(key)
                    sizes.append(len(data))
                total += len(data)
        except Exception as e:  # noqa: BLE001 - a failed store is reported as -1, not raised
            log.warning("kvtier MP l2fs store failed: %s", e)
            ok = False
        if new_keys:
            self._notify_keys_stored(new_keys, sizes)
        with self._lock:
            self._stores[tid] = L2StoreResult(ok, total if ok else 0)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # -- lookup -----------------------------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: dict[int, Any]) -> L2TaskId:
        tid = self._task()
        self._pool.submit(self._lookup, tid, list(keys))
        return tid

    def _lookup(self, tid: L2TaskId, keys: list[Any]) -> None:
        bm = Bitmap(len(keys))
        try:
            if keys and not self.gate.claiming(self.client, self._object_bytes, may_probe=not self._closed):
                self.gate.gated(len(keys))  # loading would be slower than recomputing: report nothing
                keys = []
            if keys:
                for i, st in enumerate(self.client.stat_many([self._path(k) for k in keys])):
                    if st is not None and not st.is_dir:
                        bm.set(i)
        except Exception as e:  # noqa: BLE001 - unreachable l2fs: nothing is found
            log.warning("kvtier MP l2fs lookup failed: %s", e)
        with self._lock:
            self._lookups[tid] = bm
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Nothing is pinned: l2fs never evicts a file while it is being read (blocks are immutable)."""

    # -- load -------------------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        tid = self._task()
        self._pool.submit(self._load, tid, list(keys), list(objects))
        return tid

    def _load_one(self, key: Any, obj: Any) -> bool:
        try:
            buf = _bytes(obj)
            st = self.client.stat(self._path(key))
            if st is None or st.size != buf.size:
                return False
            return self.client.get_into(self._path(key), memoryview(buf)) == buf.size
        except Exception:  # noqa: BLE001 - miss
            return False

    def _load(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        bm = Bitmap(len(keys))
        try:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(min(8, max(1, len(keys))), thread_name_prefix="kvtier-mp-load") as ex:
                results = list(ex.map(self._load_one, keys, objects))
            sizes = [_bytes(o).size for o, ok in zip(objects, results, strict=True) if ok]
            if sizes and not self._object_bytes:
                self._object_bytes = sizes[0]
                self.gate.bytes_per_token = sizes[0] / self.cfg.chunk_size
            self.gate.loaded(sum(sizes), time.perf_counter() - t0,
                             [self._path(k) for k, ok in zip(keys, results, strict=True) if ok])
            for i, ok in enumerate(results):
                if ok:
                    bm.set(i)
            hit = [k for k, ok in zip(keys, results, strict=True) if ok]
            if hit:
                self._notify_keys_accessed(hit)
        except Exception as e:  # noqa: BLE001
            log.warning("kvtier MP l2fs load failed: %s", e)
        with self._lock:
            self._loads[tid] = bm
        self._load_efd.notify()

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    # -- misc -------------------------------------------------------------------------------------------
    def delete(self, keys: list[Any]) -> None:
        gone, sizes = [], []
        for k in keys:
            try:
                st = self.client.stat(self._path(k))
                if st is not None and self.client.rm(self._path(k)):
                    gone.append(k)
                    sizes.append(st.size)
            except Exception as e:  # noqa: BLE001
                log.warning("kvtier MP l2fs delete failed: %s", e)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def report_status(self) -> dict:
        return {"is_healthy": not self._closed, "type": "L2fsL2Adapter", "master": self.cfg.master,
                "prefix": self.cfg.prefix}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=False)
        self.client.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
