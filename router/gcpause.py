"""The router process and CPython's cyclic GC: its start-up heap frozen, every collection's pause measured.

A collection stops the event loop, and a full (generation 2) one walks every tracked container: the imported
modules, the app, and the indexes' maps of hundreds of thousands of blocks (8-16 ms at start-up, 21-51 ms with a
kvaware router's indexes at 400 req/s: the e2e p99 of such a run). `freeze_startup_heap` moves everything alive
once the router serves into CPython's permanent generation, which no later collection walks; objects born later
(requests, events) are collected as before. The indexes keep their big maps in containers created before the
freeze (router.index.Table) and store atomic values in per-block maps, so those are never tracked at all.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

from prometheus_client import Histogram


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is alive (gc.freeze); returns how many objects are frozen. For the router
    process only, once it serves: frozen objects are never collected, so only long-lived ones should be."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GCPauses:
    """Observes each collection's pause (perf_counter, start to stop) into a histogram by generation."""

    def __init__(self, hist: Histogram) -> None:
        self._hist = hist
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self._hist.labels(str(info["generation"])).observe(time.perf_counter() - self._t0)

    def start(self) -> None:
        if self._cb not in gc.callbacks:
            gc.callbacks.append(self._cb)

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._cb)
