"""AsyncClient: the asyncio twin of Client (each call runs the sync one on a thread, bounded by the timeout)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from l2fs.client.errors import Unavailable
from l2fs.client.sync import Client

# Calls whose deadline is the client timeout. A call waiting for a pool thread (all busy on a hung worker)
# must not wait longer than that: reads become misses, metadata calls raise Unavailable. Measured before:
# 64 concurrent gets against a SIGSTOP'd worker took up to 8 s with a 2 s timeout (tests/reliability).
# get_many is left out: the sync call has no overall deadline (each get has its own), so a big batch may
# legitimately take longer than one timeout.
_READS = ("get", "get_into", "locate_many")  # a late locate_many is a no-op hint too: None
_BOUNDED = (*_READS, "exists", "stat", "stat_many", "prefix_lookup", "ls", "report")


def _async(name: str) -> Callable:
    sync = getattr(Client, name)

    @functools.wraps(sync)
    async def method(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        if name in _READS:  # the read's own deadline starts now, not when a pool thread frees up
            kwargs["_deadline"] = time.monotonic() + self._client.timeout
        fut = loop.run_in_executor(self._pool, functools.partial(getattr(self._client, name), *args, **kwargs))
        if name not in _BOUNDED:
            return await fut
        try:
            return await asyncio.wait_for(fut, self._client.timeout + 0.25)
        except TimeoutError:
            if name in _READS:
                return None
            raise Unavailable(f"l2fs {name}: no answer within the {self._client.timeout}s deadline") from None

    return method


class AsyncClient:
    """asyncio twin of Client with the same methods as coroutines (same arguments and conventions).

    The sync client is thread-safe, so each call runs it on a private thread pool: the event loop never
    blocks on gRPC or disk I/O.
    """

    def __init__(self, master: str | None = None, *, node_id: str | None = None, token: str | None = None,
                 tls_ca: str | None = None, timeout: float = 2.0, short_circuit: bool = True,
                 data_plane: bool | None = None, max_workers: int = 16) -> None:
        self._client = Client(master, node_id=node_id, token=token, tls_ca=tls_ca, timeout=timeout,
                              short_circuit=short_circuit, data_plane=data_plane)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="l2fs-async")

    @property
    def sync(self) -> Client:
        """The underlying synchronous client."""
        return self._client

    put = _async("put")
    get = _async("get")
    get_into = _async("get_into")
    locate_many = _async("locate_many")
    put_many = _async("put_many")
    get_many = _async("get_many")
    exists = _async("exists")
    stat = _async("stat")
    stat_many = _async("stat_many")
    prefix_lookup = _async("prefix_lookup")
    ls = _async("ls")
    mkdir = _async("mkdir")
    rmdir = _async("rmdir")
    rm = _async("rm")
    rename = _async("rename")
    report = _async("report")

    async def close(self) -> None:
        self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
