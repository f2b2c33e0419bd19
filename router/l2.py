"""kvaware's L2 view: how many leading tokens of a prompt are already in l2fs (any replica can load them).

LMCache names a chunk by a prefix-chained chunk hash (its ChunkedTokenDatabase, `builtin` hash seeded by the
replicas' PYTHONHASHSEED); where the chunk lands depends on the replicas' L2 mode:
* plugin: connector.lmcache_l2fs stores it at `<prefix>/<escaped model>/<reversible name>.data`;
* mount: stock LMCache `fs://` on an l2fs mount writes `<prefix>/<key string, '/' -> -SEP->.data`.
kvtier.contract computes both the hashes (pure Python, no LMCache, no PYTHONHASHSEED needed here) and the
names; we ask the master how many leading paths exist (`Client.prefix_lookup`, one RPC, pins nothing).
Any failure is a miss.

Key drift: the names above are only right while the replicas' LMCache hashes as kvtier.contract does. At
start-up (warm) a background thread hashes contract.KAT_TOKENS with the installed LMCache in a child process
started with the replicas' seed (contract.installed_builtin_check, ~20 s for the LMCache import). On a
mismatch kvaware gets no L2 credit at all (lookups answer 0 without asking l2fs), with one ERROR line
"KVTIER KEY DRIFT" and the gauge kvtier_router_l2_key_check{state="drift"}; until the check has answered
(state "pending") and where LMCache is not installed ("unverified": CPython's hash chain alone is checked)
lookups work as before. The router's own prefix index hashes token ids itself and is not affected.

Salted endpoints (tenant isolation, kvtier.contract.salted_prefix) write one directory deeper; the router
holds their salts: env KVTIER_KV_SALT_FILE / KVTIER_KV_SALT for --l2fs-prefix itself, and KVTIER_KV_SALT_DIR,
a directory with one file per endpoint (named as the endpoint's directory under --l2fs-prefix, e.g. a mounted
Secret with one key per endpoint), for the replicas' announced kv-prefixes. No salt file = unsalted paths.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier import contract
from kvtier import envs as kvtier_envs

log = logging.getLogger("kvtier.router.l2")
SALT_DIR_ENV = "KVTIER_KV_SALT_DIR"  # router: one salt file per endpoint directory under --l2fs-prefix


class L2Lookup:
    """Leading-chunk presence of a prompt in l2fs, computed off the event loop."""

    def __init__(self, master: str, *, mode: str = "plugin", prefix: str = contract.KV_PREFIX,
                 chunk_size: int = contract.CHUNK_SIZE, hash_seed: str = contract.HASH_SEED,
                 model_name: str | None = None, dtype: str = "float", world_size: int = 1, worker_id: int = 0,
                 rpc_timeout: float = 0.5, client: Any = None, salts: Mapping[str, bytes | str] | None = None,
                 salt_dir: str | None = None, key_check: bool = True, client_options: Any = None) -> None:
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
        self.key_check = key_check  # warm() checks the installed LMCache's keys against the contract
        self.key_state, self.key_detail = contract.KEY_PENDING, "not checked yet"
        self._key_thread: threading.Thread | None = None

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
        self.key_state, self.key_detail = state, detail
        if state == contract.KEY_DRIFT:
            log.error("KVTIER KEY DRIFT: %s; kvaware gives no L2 credit from now on (every lookup would miss "
                      "or, worse, match other chunks); replicas' own KV events still count", detail)
        elif state == contract.KEY_UNVERIFIED:
            log.warning("l2fs key check unverified: %s", detail)
        else:
            log.info("l2fs key check: %s", detail)

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
        """Connect before serving, so the first lookups are not timed-out misses; start the key check."""
        if self.key_check:
            self.start_key_check()
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._connect)
        except Exception as e:  # noqa: BLE001 - a dead master at start-up is a miss, as later
            log.warning("l2fs lookup unavailable: %s (kvaware will see no L2 hits)", e)

    async def __call__(self, tokens: list[int], model: str, prefix: str | None = None,
                       layout: tuple[str, int] | None = None) -> int:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.lookup, tokens, model, prefix,
                                                                layout)
