"""Admission control: a bounded number of requests in the router, a bounded FIFO wait queue, fast rejects.

Without it an overloaded router accepted everything and collapsed (unbounded pending work, then timeouts
for all). The gate is the request handler's first await (router.app.Router.proxy), before the body read, the
JSON parse, tokenization and any upstream call, so a rejected request costs only uvicorn's header parse. A slot is held from admission until the response has
been sent completely (the end of the stream for SSE), so `active` is the router's true concurrency.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
QUEUE_WAIT = "queue_wait"  # the wait for a slot would outlast queue_timeout: rejected at once, not after it


@dataclass
class AdmissionConfig:
    max_inflight: int = 1024  # requests past the gate, router-wide (0 = only the per-replica bound)
    max_inflight_per_replica: int = 256  # vLLM's default max_num_seqs: beyond it the engine only queues
    max_queue: int = 256  # requests waiting for a slot; one more is rejected at once
    queue_timeout: float = 2.0  # longest wait in the queue before a reject
    retry_after: int = 1  # seconds, sent with every 429/503 from the gate


class Ticket:
    """One admitted request's slot; release() is idempotent so every exit path may call it."""

    __slots__ = ("_gate", "_done", "_t0")

    def __init__(self, gate: Gate) -> None:
        self._gate, self._done, self._t0 = gate, False, time.monotonic()

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._gate._held(time.monotonic() - self._t0)
            self._gate._release()


class Gate:
    """Bounded concurrency + bounded FIFO queue. `capacity()` is re-read on every decision, because the
    per-replica bound times the replicas that take traffic changes as replicas come and go."""

    def __init__(self, cfg: AdmissionConfig, n_available: Callable[[], int]) -> None:
        self.cfg = cfg
        self._n_available = n_available
        self.active = 0
        self.queue_max_seen = 0
        self.hold_s = 0.0  # moving average of how long a slot is held (0: none released yet, no prediction)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def capacity(self) -> int:
        """Router-wide slots now: the global cap, and never more than every available replica can take, so an
        admitted request always finds a replica below its own bound (pigeonhole)."""
        per = self.cfg.max_inflight_per_replica * self._n_available() if self.cfg.max_inflight_per_replica else 0
        caps = [c for c in (self.cfg.max_inflight, per) if c > 0]
        return min(caps) if caps else 1 << 62

    def _held(self, seconds: float) -> None:
        self.hold_s = seconds if self.hold_s == 0.0 else 0.8 * self.hold_s + 0.2 * seconds

    def predicted_wait(self, position: int) -> float:
        """Seconds until the waiter at `position` (1 = next) gets a slot, if the slots now held free up at the
        average hold time, spread evenly: position x hold / capacity. 0 before any slot has been released."""
        return position * self.hold_s / max(1, min(self.capacity(), self.active or 1))

    async def enter(self) -> Ticket | str:
        """A Ticket, or the reject reason (QUEUE_FULL or QUEUE_WAIT at once, QUEUE_TIMEOUT after queue_timeout).
        QUEUE_WAIT: the predicted wait already exceeds queue_timeout, so waiting would only turn the same 429
        into a late one that held a queue place meanwhile."""
        if self.active < self.capacity() and not self._waiters:
            self.active += 1
            return Ticket(self)
        if len(self._waiters) >= self.cfg.max_queue:
            return QUEUE_FULL
        if self.predicted_wait(len(self._waiters) + 1) > self.cfg.queue_timeout:
            return QUEUE_WAIT
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.queue_max_seen = max(self.queue_max_seen, len(self._waiters))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.cfg.queue_timeout)
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # the slot arrived just as we gave up: pass it on
                self._release()
            else:
                fut.cancel()
            return QUEUE_TIMEOUT
        except asyncio.CancelledError:  # the client left while queued
            if fut.done() and not fut.cancelled():
                self._release()
            else:
                fut.cancel()
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
        return Ticket(self)  # the slot was handed over by _release: active already counts it

    def _release(self) -> None:
        while self._waiters and self.active <= self.capacity():
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand our slot to the oldest waiter: active stays the same
                return
        self.active -= 1
        self.kick()

    def kick(self) -> None:
        """Admit waiters while there is room (capacity may have grown: a replica came back)."""
        while self._waiters and self.active < self.capacity():
            fut = self._waiters.popleft()
            if not fut.done():
                self.active += 1
                fut.set_result(None)

