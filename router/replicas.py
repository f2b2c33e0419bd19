"""Replica set: membership (static or discovered), health, passive ejection and the router's own load counters.

Load is what this router has admitted and not finished (tracked at admit, first byte and finish), not
scraped metrics: scrapes are seconds stale, and concurrent bursts would all see the same old numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("kvtier.router.replicas")


@dataclass
class Replica:
    url: str  # base URL, no trailing slash
    kv_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_prefix: str | None = None  # l2fs directory of its chunks (pod annotation kvtier.io/kv-prefix); None: --l2fs-prefix
    healthy: bool = True  # optimistic until the first check says otherwise
    ejected_until: float = 0.0
    fails: int = 0  # consecutive request failures
    health_misses: int = 0  # consecutive health-check timeouts
    inflight: int = 0  # admitted, not finished
    prefill_tokens: int = 0  # uncached prompt tokens admitted and not yet at first byte
    decode_tokens: int = 0  # context tokens of requests past first byte and not finished
    served: int = 0
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return self.healthy and time.monotonic() >= self.ejected_until


class ReplicaSet:
    """All known replicas; the `on_*` callbacks keep indexes and subscribers in step with membership."""

    def __init__(self, *, health_interval: float = 2.0, health_timeout: float = 1.0, eject_seconds: float | None = None,
                 api_key: str | None = None) -> None:
        self.replicas: dict[str, Replica] = {}
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.eject_seconds = eject_seconds if eject_seconds is not None else health_interval
        self.on_added: list[Callable[[Replica], None]] = []
        self.on_removed: list[Callable[[Replica], None]] = []
        self.on_down: list[Callable[[Replica], None]] = []
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    def add(self, url: str, *, kv_endpoint: str | None = None, kv_replay_endpoint: str | None = None,
            kv_prefix: str | None = None) -> Replica:
        url = url.rstrip("/")
        r = self.replicas.get(url)
        if r is not None:
            r.kv_prefix = kv_prefix  # an annotation change on a known pod
            return r
        r = Replica(url, kv_endpoint, kv_replay_endpoint, kv_prefix)
        self.replicas[url] = r
        log.info("replica added: %s", url)
        for cb in self.on_added:
            cb(r)
        return r

    def remove(self, url: str) -> None:
        r = self.replicas.pop(url.rstrip("/"), None)
        if r is not None:
            log.info("replica removed: %s", url)
            for cb in self.on_removed:
                cb(r)

    def available(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.available]

    def soft_fail(self, r: Replica, why: str, threshold: int = 3) -> None:
        """A timeout may be overload rather than death: eject only after `threshold` in a row."""
        r.fails += 1
        if r.fails >= threshold:
            self.mark_down(r, f"{why} ({r.fails} in a row)")

    def ok(self, r: Replica) -> None:
        r.fails = 0

    def mark_down(self, r: Replica, why: str) -> None:
        """Passive ejection: a refused connection / 5xx takes the replica out until a health check passes."""
        was = r.available
        r.fails += 1
        r.healthy = False
        r.ejected_until = time.monotonic() + self.eject_seconds
        if was:
            log.warning("replica %s down: %s", r.url, why)
            for cb in self.on_down:
                cb(r)

    async def check(self, r: Replica) -> bool:
        assert self._client is not None
        dead = False
        try:
            resp = await self._client.get(r.url + "/health", timeout=self.health_timeout, headers=self._headers)
            ok = resp.status_code == 200
            dead = not ok
        except httpx.ConnectError:
            ok, dead = False, True  # refused: nobody listens
        except (httpx.HTTPError, OSError):
            ok = False  # slow: could be overload, needs a second miss in a row
        if ok:
            if not r.healthy:
                log.info("replica %s healthy again", r.url)
            r.healthy, r.fails, r.ejected_until, r.health_misses = True, 0, 0.0, 0
            return True
        r.health_misses += 1
        if (dead or r.health_misses >= 2) and (r.healthy or r.ejected_until):
            self.mark_down(r, "health check failed")
            r.ejected_until = 0.0  # stays out through `healthy` until a check passes
        return False

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in list(self.replicas.values())))

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.check_all()
            await asyncio.sleep(self.health_interval)

    def start(self) -> None:
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="health")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client:
            await self._client.aclose()
