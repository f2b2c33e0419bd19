"""LMCache remote storage plugin (in-process mode, used by LMCacheConnectorV1) that keeps chunks in l2fs.

Configure (what `kvtier lmcache-config` writes):

    remote_storage_plugins: ["l2fs"]
    extra_config:
      remote_storage_plugin.l2fs.module_path: connector.lmcache_l2fs
      remote_storage_plugin.l2fs.class_name: L2fsConnectorAdapter
      remote_storage_plugin.l2fs.master: 127.0.0.1:7070     # or $L2FS_MASTER
      remote_storage_plugin.l2fs.node_id: node-1            # or $L2FS_NODE_ID (local-first placement)
      remote_storage_plugin.l2fs.prefix: /kvtier/kv         # optional
      remote_storage_plugin.l2fs.timeout: 1.0               # per l2fs call, seconds
      remote_storage_plugin.l2fs.model_revision: 3f9a...    # optional: weights identity, for the fingerprint
                                                            # (the prefix already ends in <namespace>/<revision>)
      remote_storage_plugin.l2fs.prefill_tokens_per_s: 900  # optional ($KVTIER_PREFILL_TOKENS_PER_S): the
                                                            # engine's prefill rate; L2 hits are claimed only
                                                            # while loading beats recomputing (connector.loadgate)
      remote_storage_plugin.l2fs.prefill_tokens_per_s_file: /run/prefill  # optional ($KVTIER_PREFILL_TOKENS_
                                                            # PER_S_FILE): the figure from this file, re-read
                                                            # every 2 s (measured after start); missing = the
                                                            # figure above
      remote_storage_plugin.l2fs.load_margin: 1.0           # optional: claim while rate >= margin x needed
      remote_storage_plugin.l2fs.rate_probe_interval: 5.0   # optional: seconds between probes while not claiming
      remote_storage_plugin.l2fs.precheck_share: 0.1        # optional: a claim's first chunk must arrive within
                                                            # this share of its recompute time (0 = no check)

Design (why):
* File = LMCache fs-connector format (RemoteMetadata header + raw bytes) at a reversible name
  (connector.keys), published with put-if-absent: concurrent writers of one chunk cannot corrupt it.
* `batched_contains` / `batched_async_contains` = one l2fs PrefixLookup RPC for the whole prompt; batched gets
  locate all their chunks with one StatMany (`Client.locate_many`), not a Stat per chunk.
* Every blocking l2fs call runs on our own thread pool; LMCache's event loop only awaits.
* Any l2fs fault is a miss (None / 0 / no-op), never an exception into the engine. A circuit breaker
  stops calling an unreachable master for a back-off period (one warning per outage), so requests do not
  each wait for an RPC deadline: L1-only service until l2fs is back.
* A header that does not match the file length / chunk geometry is treated as a corrupted chunk: miss.
* Every chunk is stored with its absolute index in the prompt as l2fs order hint (connector.positions), so
  l2fs evicts the deepest chunks of a prefix chain first and a cached prefix stays whole.
* L2 hits are claimed only while loading them beats recomputing them (connector.loadgate).
* At start-up the installed LMCache's chunk keys are checked against kvtier.contract (connector.keycheck);
  on a drift nothing is written (keys no router or other replica would find), reads continue. The verdict and
  the keys computed go into this replica's key-compat record (connector.fingerprint), rewritten every
  kvtier.contract.KEY_RECORD_REFRESH_S, where routers read them (router.l2).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from connector import keycheck, positions
from connector import keys as ckeys
from connector.config import PREFILL_ENV, PREFILL_FILE_ENV, PREFILL_FILE_KEY, PREFILL_KEY, watch_prefill_file
from connector.fingerprint import publish, record_and_check
from connector.loadgate import LoadGate
from connector.logs import ensure_log_handler
from kvtier import contract
from kvtier import envs as kvtier_envs

log = logging.getLogger("kvtier.connector.l2fs")
ensure_log_handler()
PLUGIN_TYPE = contract.PLUGIN_NAME
T = TypeVar("T")
PRECHECK_KEEP = 2  # chunks read before their claim, kept for its load (at most two chunks of memory)


class L2Down(Exception):
    """Internal: the breaker is open; callers turn it into a miss."""


class Breaker:
    """Opens when an l2fs metadata call fails with Unavailable; a background probe closes it again.

    While open, every L2 operation is an immediate miss: requests never wait for an RPC deadline on a
    dead master. Logs one WARNING when L2 goes down and one when it is back, not one per request.
    """

    def __init__(self, what: str, probe: Callable[[], object], base: float = 1.0, cap: float = 15.0) -> None:
        self.what = what
        self.probe = probe
        self.base, self.cap = base, cap
        self._down = False
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def check(self) -> None:
        if self._down:
            raise L2Down(self.what)

    def failed(self, err: BaseException) -> None:
        with self._lock:
            if self._down:
                return
            self._down = True
        log.warning("kvtier: l2fs %s unreachable (%s): serving from L1 only until it is back "
                    "(probing every <= %.0f s)", self.what, err, self.cap)
        threading.Thread(target=self._probe_loop, name="kvtier-l2fs-probe", daemon=True).start()

    def _probe_loop(self) -> None:
        delay = self.base
        while not self._stop.wait(delay):
            try:
                self.probe()
            except Exception:  # noqa: BLE001 - still down
                delay = min(delay * 2, self.cap)
                continue
            with self._lock:
                self._down = False
            log.warning("kvtier: l2fs %s reachable again: L2 enabled", self.what)
            return

    def close(self) -> None:
        self._stop.set()

    @property
    def down(self) -> bool:
        return self._down


def _opt(config: Any, plugin: str, name: str, default: Any = None) -> Any:
    extra = getattr(config, "extra_config", None) or {}
    return extra.get(f"remote_storage_plugin.{plugin}.{name}", default)


class L2fsConnector(RemoteConnector):
    """RemoteConnector over the native l2fs client (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
                 plugin_name: str | None = None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        from l2fs.client import Client
        from l2fs.options import ClientOptions

        plugin = plugin_name or PLUGIN_TYPE
        cfg = config if config is not None else local_cpu_backend.config
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        # l2fs's shared client options: the plugin's settings, else the environment (one node-id default)
        opts = ClientOptions.from_mapping({k: _opt(cfg, plugin, k) for k in ("master", "node_id")})
        self.master = opts.master
        if not self.master:
            raise ValueError(f"l2fs plugin: set remote_storage_plugin.{plugin}.master or $L2FS_MASTER")
        self.node_id = opts.node_id
        self.prefix = str(_opt(cfg, plugin, "prefix", contract.KV_PREFIX)).rstrip("/") or contract.KV_PREFIX
        self.revision = str(_opt(cfg, plugin, "model_revision", "") or "")
        timeout = float(_opt(cfg, plugin, "timeout", 1.0))
        self.client = Client(self.master, node_id=self.node_id, timeout=timeout,
                             token=_opt(cfg, plugin, "token"))
        self.pool = ThreadPoolExecutor(int(_opt(cfg, plugin, "threads", 8)), thread_name_prefix="kvtier-l2fs")
        self.breaker = Breaker(f"master {self.master}", lambda: self.client.ls("/"))
        self.stats = {"get_hit": 0, "get_miss": 0, "corrupt": 0, "put": 0, "put_exists": 0, "put_fail": 0,
                      "bytes_read": 0, "read_s": 0.0, "gated": 0, "put_drift": 0, "prechecked_reused": 0}
        self.timeout = timeout
        positions.install_inprocess()  # chunk hash -> index in the prompt, for the order hints of puts
        prefill = float(_opt(cfg, plugin, PREFILL_KEY) or kvtier_envs.get(PREFILL_ENV) or 0)
        self.gate = LoadGate(self.single_token_size, prefill,
                             margin=float(_opt(cfg, plugin, "load_margin", 1.0)),
                             probe_interval=float(_opt(cfg, plugin, "rate_probe_interval", 5.0)),
                             stall_s=timeout / 2,
                             precheck_share=float(_opt(cfg, plugin, "precheck_share", 0.1)))
        prefill_file = _opt(cfg, plugin, PREFILL_FILE_KEY) or kvtier_envs.get(PREFILL_FILE_ENV)
        if prefill_file:  # a figure measured after start: the file's, while it holds one, else the fixed one
            watch_prefill_file(prefill_file, lambda v: setattr(self.gate, "prefill_tps", v or prefill))
        self._meta = local_cpu_backend.metadata
        # chunk keys of the installed LMCache vs kvtier.contract: on a drift no chunk is written (see keycheck)
        self.key_check = keycheck.run("lmcache_l2fs", keycheck.lmcache_builtin, cfg, self._meta)
        self._tls = threading.local()  # one reusable header buffer per pool thread
        self._prechecked: OrderedDict[str, tuple[bytearray, int]] = OrderedDict()  # read before their claim
        self._pre_lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()  # ends the record refresh
        log.info("kvtier l2fs connector: master=%s node=%s prefix=%s", self.master, self.node_id, self.prefix)
        # Start-up probe + key-compat fingerprint, off the caller's thread: never delays engine start.
        self.pool.submit(self._startup, cfg)

    # ---- plumbing ------------------------------------------------------------------------------------
    def _startup(self, cfg: Any) -> None:
        # the record carries our key check (the keys this LMCache computed): a router without LMCache checks them
        extra = {contract.KAT_RECORD_FIELD: self.key_check.record()}
        try:
            self._guard(lambda: self.client.mkdir(self.prefix, parents=True, exist_ok=True))
            record_and_check(self.client, cfg, self._meta, node_id=self.node_id, revision=self.revision,
                             extra=extra)
        except L2Down:
            pass
        except Exception as e:  # noqa: BLE001 - start-up must never fail because of L2
            if not self._closed:  # closed before the check ran: its channel is gone, nothing to report
                log.warning("kvtier: l2fs start-up check failed: %s", e)
        if not self._closed:
            threading.Thread(target=self._refresh_record, args=(cfg, extra), name="kvtier-l2fs-record",
                             daemon=True).start()

    def _refresh_record(self, cfg: Any, extra: dict[str, Any]) -> None:
        """Rewrite our record every KEY_RECORD_REFRESH_S: routers ignore records not rewritten for
        KEY_RECORD_MAX_AGE_S (a gone engine's), so a replaced drifted engine stops counting against L2 credit."""
        while not self._stop.wait(contract.KEY_RECORD_REFRESH_S):
            if self._closed or self.breaker.down:
                continue
            try:  # not through the breaker: requests, not this thread, decide when L2 is down
                publish(self.client, cfg, self._meta, node_id=self.node_id, revision=self.revision, extra=extra)
            except Exception as e:  # noqa: BLE001 - the next period tries again
                log.debug("kvtier: key-compat record refresh failed: %s", e)

    def _guard(self, fn: Callable[[], T]) -> T:
        """Run a metadata call through the breaker; Unavailable opens it. Other errors propagate."""
        from l2fs.client import Unavailable

        self.breaker.check()
        try:
            r = fn()
        except Unavailable as e:
            self.breaker.failed(e)
            raise L2Down(str(e)) from None
        return r

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.loop.run_in_executor(self.pool, fn, *args)

    def path(self, key: Any) -> str:
        return ckeys.key_path(self.prefix, key)

    # ---- contains ------------------------------------------------------------------------------------
    def exists_sync(self, key: Any) -> bool:
        if not self._claiming():
            return False
        try:
            return bool(self._guard(lambda: self.client.exists(self.path(key))))
        except Exception:  # noqa: BLE001 - fault = miss
            return False

    async def exists(self, key: Any) -> bool:
        return await self._run(self.exists_sync, key)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """Leading keys present in l2fs: one PrefixLookup RPC."""
        if not keys:
            return 0
        try:
            n = int(self._guard(lambda: self.client.prefix_lookup([self.path(k) for k in keys])))
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, L2Down):
                log.debug("prefix lookup failed: %s", e)
            return 0
        if n and not (self._claiming() and self._precheck(keys[0], n)):
            self.stats["gated"] += n
            self.gate.gated(n)
            return 0  # loading them would take longer than recomputing them: the engine recomputes
        return n

    # ---- never slower than recompute (connector.loadgate) ---------------------------------------------
    def _claiming(self) -> bool:
        """Claim L2 hits now? When not, a background probe (if one is due) re-measures L2."""
        return self.gate.claiming(self.client, self.remote_metadata_bytes + self.full_chunk_size_bytes,
                                  may_probe=not (self._closed or self.breaker.down))

    def _precheck(self, key: Any, chunks: int) -> bool:
        """Decide before the load (connector.loadgate): read the first claimed chunk within a tenth of what
        recomputing the claimed chunks takes; kept for the load that follows, so it is not read twice."""
        budget = self.gate.precheck_budget(chunks * self.full_chunk_size_bytes)
        if budget <= 0:
            return True
        path = self.path(key)
        buf = bytearray(self.remote_metadata_bytes + self.full_chunk_size_bytes)
        t0 = time.perf_counter()
        try:
            got = self.client.get_into(path, buf, _deadline=time.monotonic() + budget)
        except Exception:  # noqa: BLE001 - a fault is a miss: recompute
            got = None
        ok = self.gate.prechecked(got, time.perf_counter() - t0, budget)
        if ok and got is not None:
            with self._pre_lock:
                self._prechecked[path] = (buf, got)
                while len(self._prechecked) > PRECHECK_KEEP:
                    self._prechecked.popitem(last=False)
        return ok

    def _take_prechecked(self, path: str) -> tuple[bytearray, int] | None:
        with self._pre_lock:
            return self._prechecked.pop(path, None)

    def _measured(self, keys: list[Any], objs: list[Any], seconds: float) -> None:
        """One load batch for the rate estimate: delivered bytes (header included) over its wall time."""
        hits = [self.path(k) for k, o in zip(keys, objs, strict=False) if o is not None]
        nbytes = sum(self.remote_metadata_bytes + o.get_size() for o in objs if o is not None)
        self.gate.loaded(nbytes, seconds, hits)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return await self._run(self.batched_contains, keys)

    # ---- get -----------------------------------------------------------------------------------------
    def _get_sync(self, key: Any) -> Any:
        if self._closed:
            return None
        try:
            self.breaker.check()
        except L2Down:
            return None
        t0 = time.perf_counter()
        pre = self._take_prechecked(self.path(key))
        if pre is not None:  # read by the check before its claim: not read twice
            self.stats["prechecked_reused"] += 1
            obj = self._chunk_from(key, *pre)
        else:
            obj = self._read_chunk(key)
        if obj is not None:
            self.stats["get_hit"] += 1
            self.stats["bytes_read"] += self.remote_metadata_bytes + obj.get_size()
            self.stats["read_s"] += time.perf_counter() - t0
        return obj

    def _read_chunk(self, key: Any) -> Any:
        """Read a chunk straight into an L1 object of the full-chunk geometry (a scatter read: the header into a
        small buffer, the KV into the object; no staging copy). A chunk of another geometry (a partial last
        chunk, a layerwise format) is moved into an object of its own shape: one copy, as before."""
        hdr = self.remote_metadata_bytes
        obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        if obj is None:
            return None  # L1 full: a miss, not an error
        head = getattr(self._tls, "head", None)  # only this pool thread writes it (the sync client reads here)
        if head is None or len(head) != hdr:
            head = self._tls.head = bytearray(hdr)
        body = np.frombuffer(obj.byte_array, dtype=np.uint8)  # byte_array may be '<B': go through numpy
        keep = False
        try:
            if body.size != self.full_chunk_size_bytes:
                raise ValueError(f"allocated {body.size} bytes for a {self.full_chunk_size_bytes}-byte chunk")
            try:
                n = self.client.get_into(self.path(key), [head, body])
            except Exception as e:  # noqa: BLE001 - larger than any chunk, bad path, ...: a miss
                log.warning("kvtier: l2fs chunk %s unreadable (%s): miss", key.chunk_hash, e)
                self.stats["corrupt"] += 1
                return None
            if n is None:
                self.stats["get_miss"] += 1
                return None
            md = self._header(key, head, n)
            if md is None:
                return None
            if (md.length == self.full_chunk_size_bytes and md.fmt == self.meta_fmt
                    and list(md.shapes) == list(self.meta_shapes)):
                keep = True
                return obj
            return self._into_own_shape(md, body, key)  # read where it was, moved once into its own shape
        finally:
            if not keep:
                obj.ref_count_down()

    def _chunk_from(self, key: Any, buf: bytearray, n: int) -> Any:
        """An L1 object for a chunk already read into buf (header + KV), or None."""
        md = self._header(key, buf, n)
        if md is None:
            return None
        return self._into_own_shape(md, np.frombuffer(buf, dtype=np.uint8, count=md.length,
                                                      offset=self.remote_metadata_bytes), key)

    def _header(self, key: Any, head: bytearray, n: int) -> Any:
        """The chunk's RemoteMetadata when it matches the bytes read and the engine's geometry, else None
        (counted as corrupt: a miss)."""
        hdr = self.remote_metadata_bytes
        try:
            if n < hdr:
                raise ValueError(f"{n} bytes is shorter than the header")
            md = RemoteMetadata.deserialize(bytes(head[:hdr]))
            if md.length != n - hdr or md.length <= 0 or md.length > self.full_chunk_size_bytes:
                raise ValueError(f"header length {md.length} vs {n - hdr} data bytes")
            # Any MemoryFormat the header names is fine (layerwise stores KV_T2D/KV_2TD, not meta_fmt), as in
            # LMCache's fs connector; the dtype must still be the engine's.
            if list(md.dtypes) != list(self.meta_dtypes):
                raise ValueError(f"dtypes {md.dtypes} != {self.meta_dtypes}")
            want = sum(s.numel() * d.itemsize for s, d in zip(md.shapes, md.dtypes, strict=True))
            if want != md.length:
                raise ValueError(f"shapes {md.shapes} need {want} bytes, header says {md.length}")
        except Exception as e:  # noqa: BLE001
            log.warning("kvtier: corrupted l2fs chunk %s (%s): miss", self.path(key), e)
            self.stats["corrupt"] += 1
            return None
        return md

    def _into_own_shape(self, md: Any, data: np.ndarray, key: Any) -> Any:
        """Copy md.length bytes of data into a fresh L1 object of the header's shapes and format."""
        obj = self.local_cpu_backend.allocate(md.shapes, md.dtypes, md.fmt)
        if obj is None:
            return None  # L1 full: a miss, not an error
        try:
            dst = np.frombuffer(obj.byte_array, dtype=np.uint8)
            if dst.size != md.length:
                raise ValueError(f"allocated {dst.size} bytes for {md.length}")
            dst[:] = data[:md.length]
        except Exception as e:  # noqa: BLE001
            log.warning("kvtier: corrupted l2fs chunk %s (%s): miss", self.path(key), e)
            self.stats["corrupt"] += 1
            obj.ref_count_down()
            return None
        return obj

    async def get(self, key: Any) -> Any:
        return await self._run(self._get_sync, key)

    def support_batched_get(self) -> bool:
        return True

    def _locate_sync(self, keys: list[Any]) -> None:
        """Where the batch's chunks live, in one master round trip (StatMany) instead of one Stat per get.
        A hint: on any fault the gets locate one by one (and still miss cleanly)."""
        if self._closed or self.breaker.down or len(keys) < 2:
            return
        try:
            self.client.locate_many([self.path(k) for k in keys])
        except Exception as e:  # noqa: BLE001 - never an exception into the engine
            log.debug("locate_many failed: %s", e)

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        """One StatMany for the batch, then parallel fetches on our pool; one None per miss."""
        t0 = time.perf_counter()
        await self._run(self._locate_sync, keys)
        objs = list(await asyncio.gather(*(self.get(k) for k in keys)))
        self._measured(keys, objs, time.perf_counter() - t0)
        return objs

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The base class's (parallel get(), keep the hit prefix), after one StatMany for the batch."""
        t0 = time.perf_counter()
        await self._run(self._locate_sync, keys)
        objs = await super().batched_get_non_blocking(lookup_id, keys)
        self._measured(list(keys)[:len(objs)], list(objs), time.perf_counter() - t0)
        return objs

    # ---- put -----------------------------------------------------------------------------------------
    def _put_sync(self, key: Any, memory_obj: Any) -> None:
        self._put_many_sync([key], [memory_obj])

    def _put_many_sync(self, keys: list[Any], memory_objs: list[Any]) -> None:
        """The whole batch in one `put_many` (one AllocateMany + one CommitMany on the master); each chunk
        is its own put-if-absent, and a failed chunk only costs that chunk a future miss."""
        from l2fs.client import Busy, Unavailable

        if self._closed or not keys:
            return
        if not self.key_check.writes_allowed:  # keys nobody could find: write nothing (logged at start-up)
            self.stats["put_drift"] += len(keys)
            return
        counted = False

        def put_batch() -> list[Any]:
            nonlocal counted
            items = []
            for key, memory_obj in zip(keys, memory_objs, strict=True):
                data = memory_obj.byte_array
                md = RemoteMetadata(len(data), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                    memory_obj.get_memory_format())
                blob = bytearray(md.serialize())
                blob += data
                items.append((self.path(key), blob))
            # each chunk's index from the start of its prompt (not the batch order: a batch may extend a
            # cached prefix), so l2fs evicts the deepest chunks of a chain first
            hints = positions.INDEX.hints(k.chunk_hash for k in keys)
            results = self.client.put_many(items, if_absent=True, order_hints=hints, return_exceptions=True)
            for key, r in zip(keys, results, strict=True):
                if isinstance(r, BaseException):
                    self.stats["put_fail"] += 1
                    log.warning("kvtier: l2fs put %s failed: %s", key.chunk_hash, r)
                else:
                    self.stats["put" if r else "put_exists"] += 1
            counted = True
            # a busy worker (reservation cap) is a miss for its chunks, not an outage: the breaker stays closed
            down = next((r for r in results if isinstance(r, Unavailable) and not isinstance(r, Busy)), None)
            if down is not None:
                raise down  # counted above; the breaker sees the outage
            return results

        try:
            self._guard(put_batch)
        except L2Down:
            if not counted:  # the breaker was open: nothing was tried
                self.stats["put_fail"] += len(keys)
        except Exception as e:  # noqa: BLE001 - a failed store only costs a future miss
            if not counted:
                self.stats["put_fail"] += len(keys)
            log.warning("kvtier: l2fs batched put of %d chunks failed: %s", len(keys), e)

    async def put(self, key: Any, memory_obj: Any) -> None:
        # InstrumentedRemoteConnector drops the reference after we return; we only read the bytes.
        await self._run(self._put_sync, key, memory_obj)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await self._run(self._put_many_sync, list(keys), list(memory_objs))

    # ---- misc ----------------------------------------------------------------------------------------
    def remove_sync(self, key: Any) -> bool:
        try:
            return bool(self._guard(lambda: self.client.rm(self.path(key))))
        except Exception:  # noqa: BLE001
            return False

    async def list(self) -> list[str]:
        def _ls() -> list[str]:
            try:
                infos = self._guard(lambda: self.client.ls(ckeys.model_dir(self.prefix, self._meta.model_name)))
            except Exception:  # noqa: BLE001
                return []
            out = []
            for i in infos:
                try:
                    out.append(ckeys.name_to_key(i.path.rsplit("/", 1)[-1]).to_string())
                except ValueError:
                    continue
            return out

        return await self._run(_ls)

    async def close(self) -> None:
        self._closed = True
        self._stop.set()
        self.breaker.close()
        self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"<L2fsConnector {self.master} {self.prefix}>"


class L2fsConnectorAdapter(ConnectorAdapter):
    """Adapter LMCache loads from `remote_storage_plugin.<name>.class_name`; accepts plugin://l2fs[.x]."""

    def __init__(self) -> None:
        super().__init__("l2fs://")

    def can_parse(self, url: str) -> bool:
        if url.startswith(self.schema):
            return True
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return L2fsConnector(context.loop, context.local_cpu_backend, context.config,
                             plugin_name=context.plugin_name)
