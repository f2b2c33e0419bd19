"""kvaware's L2 view: how many leading tokens of a prompt are already in l2fs (any replica can load them).

LMCache names a chunk by a prefix-chained chunk hash (its ChunkedTokenDatabase, `builtin` hash with the
replicas' PYTHONHASHSEED) and the connector stores it at `<prefix>/<model>/<key name>.data`
(connector/keys.py). We compute the same chunk hashes with LMCache's own token database, build the same
paths, and ask the master how many leading paths exist (`Client.prefix_lookup`, one RPC, pins nothing).
Heavy imports (lmcache, vllm hashing) happen only when `--l2fs-master` is given. Any failure is a miss.
Run the router with the replicas' PYTHONHASHSEED (kvtier uses 0), or the hashes will not match.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvtier.router.l2")


@dataclass
class _Key:
    """Duck-typed CacheEngineKey: the fields connector.keys.key_to_name reads."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    _dtype_str: str
    tags: tuple = ()


class L2Lookup:
    def __init__(self, master: str, *, prefix: str = "/kvtier/kv", chunk_size: int = 256,
                 model_name: str | None = None, dtype: str = "float", world_size: int = 1, worker_id: int = 0,
                 timeout: float = 0.5, client: Any = None) -> None:
        self.master, self.prefix, self.chunk_size = master, prefix.rstrip("/"), chunk_size
        self.model_name, self.dtype = model_name, dtype
        self.world_size, self.worker_id = world_size, worker_id
        self.timeout = timeout
        self._client = client
        self._db: Any = None
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-l2")
        self._hash_cache: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self.errors = 0

    def _setup(self) -> None:
        if self._db is None:
            from lmcache.v1.token_database import ChunkedTokenDatabase

            db = ChunkedTokenDatabase()  # builtin hash: what connector.config sets for the replicas
            db.chunk_size = self.chunk_size
            self._db = db
        if self._client is None:
            from l2fs.client import Client

            self._client = Client(self.master, timeout=self.timeout)

    def chunk_hashes(self, tokens: list[int]) -> list[int]:
        """LMCache's chunk hashes for the full chunks of `tokens` (cached by prompt)."""
        self._setup()
        n = len(tokens) // self.chunk_size * self.chunk_size
        key = tuple(tokens[:n])
        got = self._hash_cache.get(key)
        if got is None:
            got = [int(h) for _s, _e, h in self._db.process_tokens(tokens=list(key), make_key=False)]
            self._hash_cache[key] = got
            while len(self._hash_cache) > 1024:
                self._hash_cache.popitem(last=False)
        return got

    def paths(self, tokens: list[int], model: str) -> list[str]:
        from connector.keys import key_path  # the connector's naming is the contract for L2 file names

        name = self.model_name or model
        return [key_path(self.prefix, _Key(name, self.world_size, self.worker_id, h, self.dtype))
                for h in self.chunk_hashes(tokens)]

    def lookup(self, tokens: list[int], model: str) -> int:
        """Blocking: leading tokens present in L2 (0 on any error: a miss, never a failure)."""
        try:
            paths = self.paths(tokens, model)
            if not paths:
                return 0
            return int(self._client.prefix_lookup(paths)) * self.chunk_size
        except Exception as e:  # noqa: BLE001 - L2 trouble must never fail routing
            self.errors += 1
            if self.errors <= 3 or self.errors % 1000 == 0:
                log.warning("l2fs prefix lookup failed (%d so far): %s", self.errors, e)
            return 0

    async def warm(self) -> None:
        """Import LMCache and connect before serving, so the first lookups are not timed-out misses."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.chunk_hashes, [0] * self.chunk_size)
        except Exception as e:  # noqa: BLE001
            log.warning("l2fs lookup unavailable: %s (kvaware will see no L2 hits)", e)

    async def __call__(self, tokens: list[int], model: str) -> int:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.lookup, tokens, model)
