"""kvaware's L2 view: how many leading tokens of a prompt are already in l2fs (any replica can load them).

LMCache names a chunk by a prefix-chained chunk hash (its ChunkedTokenDatabase, `builtin` hash seeded by the
replicas' PYTHONHASHSEED); where the chunk lands depends on the replicas' L2 mode:
* plugin: connector.lmcache_l2fs stores it at `<prefix>/<escaped model>/<reversible name>.data`;
* mount: stock LMCache `fs://` on an l2fs mount writes `<prefix>/<key string, '/' -> -SEP->.data`.
kvtier.contract computes both the hashes (pure Python, no LMCache, no PYTHONHASHSEED needed here) and the
names; we ask the master how many leading paths exist (`Client.prefix_lookup`, one RPC, pins nothing).
Any failure is a miss.

Key drift: the names above are only right while the replicas' LMCache hashes as kvtier.contract does. Two
sources of evidence, combined into one state (key_state):
* local, once: at start-up (warm) a background thread hashes contract.KAT_TOKENS with the installed LMCache in a
  child process started with the replicas' seed (contract.installed_builtin_check, ~20 s for the LMCache import).
  Where LMCache is not installed (the router image) it answers "unverified" (CPython's hash chain alone).
* the engines' records, every key_records_interval (60 s) on its own thread: the LMCache plugin publishes the
  keys ITS installed LMCache computed for KAT_TOKENS in its key-compat record (<META_PREFIX>/<model>/<replica>
  .json, contract.KAT_RECORD_FIELD); we recompute them (contract.kat_record_verdict). Records of the configured
  --l2fs-model-name, else of every model; at most RECORDS_MAX per scan; records not rewritten within
  key_records_max_age (a gone engine's), without the field (older engines) or malformed (logged once) are no
  evidence; a scan that fails changes nothing. Each scan replaces the previous one's verdict, so a drift
  clears once the drifted engines' records agree again or age out.
Any drift (local, or one engine record that disagrees or says drift) = kvaware gets no L2 credit at all (lookups
answer 0 without asking l2fs), one ERROR line "KVTIER KEY DRIFT" naming the source, and the gauge
kvtier_router_l2_key_check{state="drift"}. Otherwise "ok" when either source verified the keys, "pending" until
the local check answered (lookups work as before), else "unverified" (no LMCache here and no engine records:
mount-mode engines run stock LMCache and publish none). The router's own prefix index hashes token ids itself
and is not affected.

Salted endpoints (tenant isolation, kvtier.contract.salted_prefix) write one directory deeper; the router
holds their salts: env KVTIER_KV_SALT_FILE / KVTIER_KV_SALT for --l2fs-prefix itself, and KVTIER_KV_SALT_DIR,
a directory with one file per endpoint (named as the endpoint's directory under --l2fs-prefix, e.g. a mounted
Secret with one key per endpoint), for the replicas' announced kv-prefixes. No salt file = unsalted paths.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier import contract
from kvtier import envs as kvtier_envs

log = logging.getLogger("kvtier.router.l2")
SALT_DIR_ENV = "KVTIER_KV_SALT_DIR"  # router: one salt file per endpoint directory under --l2fs-prefix
RECORDS_MAX = 256  # engine key-compat records read per scan (model directories: MODEL_DIRS_MAX)
MODEL_DIRS_MAX = 64


class L2Lookup:
    """Leading-chunk presence of a prompt in l2fs, computed off the event loop."""

    def __init__(self, master: str, *, mode: str = "plugin", prefix: str = contract.KV_PREFIX,
                 chunk_size: int = contract.CHUNK_SIZE, hash_seed: str = contract.HASH_SEED,
                 model_name: str | None = None, dtype: str = "float", world_size: int = 1, worker_id: int = 0,
                 rpc_timeout: float = 0.5, client: Any = None, salts: Mapping[str, bytes | str] | None = None,
                 salt_dir: str | None = None, key_check: bool = True, client_options: Any = None,
                 key_records_interval: float = 60.0,
                 key_records_max_age: float = contract.KEY_RECORD_MAX_AGE_S) -> None:
        if mode not in contract.L2_MODES:
            raise ValueError(f"unknown l2fs mode {mode!r}; choose one of {', '.join(contract.L2_MODES)}")
        contract.none_hash(hash_seed)  # a bad seed fails at start-up, not as a silent miss per request
        self.master, self.mode, self.prefix, self.chunk_size = master, mode, prefix.rstrip("/"), chunk_size
        self.hash_seed, self.model_name, self.dtype = hash_seed, model_name, dtype
        self.world_size, self.worker_id = world_size, worker_id
        self.rpc_timeout = rpc_timeout  # deadline of the l2fs client's RPCs (the router's own budget is l2_timeout)
        self._client = client
        self.client_options = client_options  # l2fs.options.ClientOptions: token, TLS CA, node id (else the env's)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-l2")
        self._hash_cache: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self.errors = 0
        # tenant isolation: salt per (unsalted) prefix, then per endpoint file in salt_dir (env by default)
        self.salts = {k.rstrip("/"): contract.check_salt(v) for k, v in (salts or {}).items()}
        default = contract.env_salt()
        if default and self.prefix not in self.salts:
            self.salts[self.prefix] = default
        self.salt_dir = salt_dir if salt_dir is not None else kvtier_envs.get(SALT_DIR_ENV)
        self._salt_files: dict[str, tuple[float, bytes]] = {}
        # key drift (module doc): warm() checks the installed LMCache's keys and starts reading engine records
        self.key_check = key_check
        self.key_records_interval, self.key_records_max_age = key_records_interval, key_records_max_age
        self.key_state, self.key_detail = contract.KEY_PENDING, "not checked yet"
        self._local_key: tuple[str, str] = (contract.KEY_PENDING, "not checked yet")
        self._record_key: tuple[str, str] | None = None  # the last scan's verdict; None = no evidence
        self._key_lock = threading.Lock()
        self._bad_records: set[tuple[str, float]] = set()  # malformed records already logged (path, mtime)
        self._scan_errors = 0
        self._key_thread: threading.Thread | None = None
        self._records_thread: threading.Thread | None = None
        self._records_stop = threading.Event()
        self._connect_lock = threading.Lock()

    def start_key_check(self) -> None:
        """Check the installed LMCache's chunk keys against the contract, off the event loop (once)."""
        if self._key_thread is not None:
            return
        self._key_thread = threading.Thread(target=self._check_keys, name="kvtier-l2-keycheck", daemon=True)
        self._key_thread.start()

    def _check_keys(self) -> None:
        try:
            state, detail = contract.installed_builtin_check(self.hash_seed, self.chunk_size)
        except Exception as e:  # noqa: BLE001 - a broken check is no verdict, never a router failure
            state, detail = contract.KEY_UNVERIFIED, f"the check could not run: {e}"
        if state == contract.KEY_UNVERIFIED:
            log.warning("l2fs key check unverified: %s", detail)
        elif state == contract.KEY_OK:
            log.info("l2fs key check: %s", detail)
        with self._key_lock:
            self._local_key = (state, detail)
            self._combine()

    def start_key_records(self) -> None:
        """Read the engines' key-check records now and every key_records_interval s, on a thread of its own."""
        if self._records_thread is not None or self.key_records_interval <= 0:
            return
        self._records_thread = threading.Thread(target=self._records_loop, name="kvtier-l2-keyrecords",
                                                daemon=True)
        self._records_thread.start()

    def _records_loop(self) -> None:
        while True:
            self.scan_key_records()
            if self._records_stop.wait(self.key_records_interval):
                return

    def scan_key_records(self) -> None:
        """One scan of the engines' records (blocking); a scan that fails changes nothing."""
        try:
            got = self._read_records()
        except Exception as e:  # noqa: BLE001 - l2fs trouble is no verdict, never a router failure
            self._scan_errors += 1
            if self._scan_errors <= 3 or self._scan_errors % 100 == 0:
                log.warning("l2fs key records unreadable (%d so far): %s; the key check state stays %s",
                            self._scan_errors, e, self.key_state)
            return
        with self._key_lock:
            self._record_key = got
            self._combine()

    def _read_records(self) -> tuple[str, str] | None:
        from l2fs.client import NotFound

        client = self._connect()
        if self.model_name:
            dirs = [contract.model_dir(contract.META_PREFIX, self.model_name)]
        else:
            try:
                dirs = [i.path for i in client.ls(contract.META_PREFIX) if i.is_dir][:MODEL_DIRS_MAX]
            except NotFound:
                return None
        now, read = time.time(), 0
        ok: list[str] = []
        drift: list[str] = []
        for d in dirs:
            try:
                infos = client.ls(d)
            except NotFound:
                continue
            for info in infos:
                if info.is_dir or not info.path.endswith(".json"):
                    continue
                if self.key_records_max_age > 0 and info.mtime and now - info.mtime > self.key_records_max_age:
                    continue  # not rewritten for that long: a gone engine's
                if read >= RECORDS_MAX:
                    break
                read += 1
                raw = client.get(info.path)
                if raw is None:
                    continue
                try:
                    rec = json.loads(raw)
                    verdict = contract.kat_record_verdict(rec)
                except (ValueError, TypeError) as e:
                    if (info.path, info.mtime) not in self._bad_records:
                        self._bad_records.add((info.path, info.mtime))
                        log.warning("l2fs key record %s ignored (malformed: %s)", info.path, e)
                    continue
                if verdict is None:
                    continue
                who = f"engine replica {str(rec.get('replica'))[:100]!r} (node {str(rec.get('node_id'))[:100]!r})"
                (drift if verdict[0] == contract.KEY_DRIFT else ok).append(f"{who}: {verdict[1]}")
        if drift:
            more = f" (and {len(drift) - 3} more)" if len(drift) > 3 else ""
            return contract.KEY_DRIFT, "; ".join(drift[:3]) + more
        if ok:
            return contract.KEY_OK, f"verified by {len(ok)} engine record{'s' if len(ok) > 1 else ''}"
        return None

    def _combine(self) -> None:
        """key_state from the local check and the last records scan (module doc); logs changes. Under _key_lock."""
        (local, ldetail), rec = self._local_key, self._record_key
        if local == contract.KEY_DRIFT:
            state, detail = local, f"installed LMCache: {ldetail}"
        elif rec is not None and rec[0] == contract.KEY_DRIFT:
            state, detail = rec
        elif rec is not None:
            state, detail = rec[0], rec[1] + (f"; installed LMCache: {ldetail}" if local == contract.KEY_OK else "")
        else:
            state, detail = local, ldetail
        before = (self.key_state, self.key_detail)
        self.key_state, self.key_detail = state, detail
        if (state, detail) == before:
            return
        if state == contract.KEY_DRIFT:
            log.error("KVTIER KEY DRIFT: %s; kvaware gives no L2 credit from now on (every lookup would miss "
                      "or, worse, match other chunks); replicas' own KV events still count", detail)
        elif before[0] == contract.KEY_DRIFT:
            log.warning("l2fs key check: drift cleared, L2 credit resumes: %s (%s)", state, detail)
        elif rec is not None and state == contract.KEY_OK:
            log.info("l2fs key check: ok (%s)", detail)

    def salt_for(self, prefix: str) -> bytes | None:
        """The salt of a chunk directory: configured for it, else its endpoint's file in salt_dir, else None."""
        if prefix in self.salts:
            return self.salts[prefix]
        if not self.salt_dir or not prefix.startswith(self.prefix + "/"):
            return None
        endpoint = prefix[len(self.prefix) + 1:].split("/", 1)[0]
        if endpoint in ("", ".", ".."):
            return None
        path = os.path.join(self.salt_dir, endpoint)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return None  # an unsalted endpoint
        got = self._salt_files.get(path)
        if got is None or got[0] != mtime:  # a rotated Secret is re-read
            got = (mtime, contract.read_salt(path))
            self._salt_files[path] = got
        return got[1]

    def _connect(self) -> Any:
        if self._client is None:
            with self._connect_lock:  # the lookup pool and the records thread: one client
                if self._client is None:
                    from l2fs.client import Client

                    kw = self.client_options.client_kwargs() if self.client_options is not None else {}
                    self._client = Client(self.master, **{**kw, "timeout": self.rpc_timeout})
        return self._client

    def chunk_hashes(self, tokens: list[int]) -> list[int]:
        """LMCache's chunk hashes for the full chunks of `tokens` (cached by prompt)."""
        n = len(tokens) // self.chunk_size * self.chunk_size
        key = tuple(tokens[:n])
        got = self._hash_cache.get(key)
        if got is None:
            got = contract.chunk_hashes(key, self.chunk_size, self.hash_seed)
            self._hash_cache[key] = got
            while len(self._hash_cache) > 1024:
                self._hash_cache.popitem(last=False)
        return got

    def paths(self, tokens: list[int], model: str, prefix: str | None = None,
              layout: tuple[str, int] | None = None) -> list[str]:
        """Chunk file names under `prefix` (a replica's announced kv-prefix), else under --l2fs-prefix; `layout`
        (its announced LMCache dtype and world size) replaces --l2fs-dtype and the world size (rank 0's
        chunks are looked up: every rank of a tensor-parallel engine stores its own)."""
        name = self.model_name or model
        where = prefix.rstrip("/") if prefix else self.prefix
        where = contract.salted_prefix(where, self.salt_for(where))
        dtype, world, rank = (layout[0], layout[1], 0) if layout else (self.dtype, self.world_size, self.worker_id)
        return [contract.chunk_path(self.mode, where, name, world, rank, h, dtype)
                for h in self.chunk_hashes(tokens)]

    def lookup(self, tokens: list[int], model: str, prefix: str | None = None,
               layout: tuple[str, int] | None = None) -> int:
        """Blocking: leading tokens present in L2 (0 on any error: a miss, never a failure)."""
        if self.key_state == contract.KEY_DRIFT:  # the replicas' keys are not ours: no L2 credit
            return 0
        try:
            paths = self.paths(tokens, model, prefix, layout)
            if not paths:
                return 0
            return int(self._connect().prefix_lookup(paths)) * self.chunk_size
        except Exception as e:  # noqa: BLE001 - L2 trouble must never fail routing
            self.errors += 1
            if self.errors <= 3 or self.errors % 1000 == 0:
                log.warning("l2fs prefix lookup failed (%d so far): %s", self.errors, e)
            return 0

    async def warm(self) -> None:
        """Connect before serving, so the first lookups are not timed-out misses; start the key checks."""
        if self.key_check:
            self.start_key_check()
            self.start_key_records()
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._connect)
        except Exception as e:  # noqa: BLE001 - a dead master at start-up is a miss, as later
            log.warning("l2fs lookup unavailable: %s (kvaware will see no L2 hits)", e)

    async def __call__(self, tokens: list[int], model: str, prefix: str | None = None,
                       layout: tuple[str, int] | None = None) -> int:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.lookup, tokens, model, prefix,
                                                                layout)
