"""Replica set: membership (static or discovered), health, passive ejection and the router's own load counters.

Load has two parts. What this router has admitted and not finished (tracked at admit, first byte and finish)
is exact and fresh: concurrent bursts see each other at once. What OTHER routers sent is derived from the
replica itself: every `scrape_interval` we read vLLM's `vllm:num_requests_running` / `vllm:num_requests_waiting`
from its /metrics and subtract what we had in flight there at that moment; the rest is everyone else's
(`Replica.ext_running` / `ext_waiting`). So N routers see the same load without sharing any state; that part
is a scrape old, which is fine for load that other routers hold for seconds.
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
    # (LMCache dtype, world size) of its chunk keys (pod annotations kvtier.io/kv-dtype, kv-world-size);
    # None: --l2fs-dtype and world size 1
    kv_layout: tuple[str, int] | None = None
    healthy: bool = True  # optimistic until the first check says otherwise
    ejected_until: float = 0.0
    fails: int = 0  # consecutive request failures
    health_misses: int = 0  # consecutive health-check timeouts
    inflight: int = 0  # admitted, not finished
    prefill_tokens: int = 0  # uncached prompt tokens admitted and not yet at first byte
    decode_tokens: int = 0  # context tokens of requests past first byte and not finished
    served: int = 0
    ext_running: float = 0.0  # other routers' requests running on it (scraped, see the module docstring)
    ext_waiting: float = 0.0  # other routers' requests queued in it
    scraped_at: float = 0.0  # monotonic time of the last good scrape (0: never)
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return self.healthy and time.monotonic() >= self.ejected_until

    @property
    def load(self) -> float:
        """Requests on this replica: ours (exact, now) plus other routers' (from its last scrape)."""
        return self.inflight + self.ext_running + self.ext_waiting

    def scraped(self, running: float, waiting: float, own: int) -> None:
        """Record one /metrics reading; `own` = our in-flight count around it (the larger of before and
        after). The engine counts our requests too; the surplus is other routers'. Requests we have admitted
        but not yet delivered make `own` too large for a moment: clamped at 0, never negative load. Waiting
        ones are others' first."""
        ext = max(0.0, running + waiting - own)
        self.ext_waiting = min(waiting, ext)
        self.ext_running = ext - self.ext_waiting
        self.scraped_at = time.monotonic()


RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


def parse_load(text: str) -> tuple[float, float] | None:
    """(running, waiting) summed over label sets (one per engine / model) from a Prometheus text page;
    None when the page has neither (not a vLLM: no load signal, not zero load)."""
    got = {RUNNING: 0.0, WAITING: 0.0}
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in got:
            try:
                got[name] += float(line.rsplit(" ", 1)[1])
                seen = True
            except (ValueError, IndexError):
                continue
    return (got[RUNNING], got[WAITING]) if seen else None


class ReplicaSet:
    """All known replicas; the `on_*` callbacks keep indexes and subscribers in step with membership."""

    def __init__(self, *, health_interval: float = 2.0, health_timeout: float = 1.0, eject_seconds: float | None = None,
                 api_key: str | None = None, scrape_interval: float = 0.0) -> None:
        self.replicas: dict[str, Replica] = {}
        self.health_interval = health_interval
        self.scrape_interval = scrape_interval  # 0: no scraping, only this router's own load counts
        self.health_timeout = health_timeout
        self.eject_seconds = eject_seconds if eject_seconds is not None else health_interval
        self.on_added: list[Callable[[Replica], None]] = []
        self.on_removed: list[Callable[[Replica], None]] = []
        self.on_down: list[Callable[[Replica], None]] = []
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._task: asyncio.Task[None] | None = None
        self._scrape_task: asyncio.Task[None] | None = None
        self.scrape_errors = 0
        self._client: httpx.AsyncClient | None = None

    def add(self, url: str, *, kv_endpoint: str | None = None, kv_replay_endpoint: str | None = None,
            kv_prefix: str | None = None, kv_layout: tuple[str, int] | None = None) -> Replica:
        url = url.rstrip("/")
        r = self.replicas.get(url)
        if r is not None:
            r.kv_prefix, r.kv_layout = kv_prefix, kv_layout  # an annotation change on a known pod
            return r
        r = Replica(url, kv_endpoint, kv_replay_endpoint, kv_prefix, kv_layout)
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

    async def scrape(self, r: Replica) -> None:
        """One /metrics read of r; a failure or a page without vLLM's load gauges leaves the old reading,
        which expires after 3 intervals (then other routers' load counts as 0 again: we know nothing)."""
        assert self._client is not None
        # Our in-flight count both before and after the read, and the larger one: a request we admitted or
        # finished while the page was rendered may or may not be in the engine's figures, and counting it as
        # ours at worst hides one scrape's worth of others' load, while counting it as theirs put phantom
        # load on the replica our own burst was filling and split that burst (the smaller one did).
        own = r.inflight
        try:
            resp = await self._client.get(r.url + "/metrics", timeout=self.health_timeout, headers=self._headers)
            got = parse_load(resp.text) if resp.status_code == 200 else None
        except (httpx.HTTPError, OSError):
            got = None
        if got is not None:
            r.scraped(got[0], got[1], max(own, r.inflight))
            return
        self.scrape_errors += 1
        if r.scraped_at and time.monotonic() - r.scraped_at > 3 * self.scrape_interval:
            r.ext_running = r.ext_waiting = 0.0
            r.scraped_at = 0.0

    async def _scrape_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await asyncio.gather(*(self.scrape(r) for r in list(self.replicas.values()) if r.available))
            await asyncio.sleep(self.scrape_interval)

    def start(self) -> None:
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="health")
        if self.scrape_interval > 0:
            self._scrape_task = loop.create_task(self._scrape_loop(), name="load-scrape")

    async def stop(self) -> None:
        for task in (self._task, self._scrape_task):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._client:
            await self._client.aclose()
