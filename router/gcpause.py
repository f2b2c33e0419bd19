"""The router process and CPython's cyclic GC: its start-up heap frozen, every collection's pause measured.

A collection stops the event loop, and a full (generation 2) one walks every tracked container: the imported
modules, the app, and the indexes' maps of hundreds of thousands of blocks (8-16 ms at start-up, 77-92 ms with a
prefixaware or kvaware router's state at 400 req/s: the e2e p99 of such runs). `freeze_startup_heap` moves
everything alive once the router serves into CPython's permanent generation, which no later collection walks;
objects born later (requests, events) are collected as before. The indexes keep their big maps in containers
created before the freeze (router.index.Table) and store atomic values in per-block maps, so those are never
tracked at all (docs/results/2026-12-04-router-gc.md).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily

from router.metrics import FAST_BUCKETS as BUCKETS

NAME = "kvtier_router_gc_pause_seconds"


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is alive (gc.freeze); returns how many objects are frozen. For the router
    process only, once it serves: frozen objects are never collected, so only long-lived ones should be."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GCPauses:
    """Each collection's pause (perf_counter, start to stop) by generation, as a Prometheus histogram collector.

    The callback runs inside a collection, and a collection can start in any thread at any allocation, also while
    that thread holds a prometheus_client lock (a scrape copies a metric's children under its lock): taking one
    there would deadlock the thread. So the callback only adds to plain lists, read when the registry is scraped.
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._counts = [[0] * (len(BUCKETS) + 1) for _ in range(3)]  # per bucket, not cumulative; last = +Inf
        self._sums = [0.0, 0.0, 0.0]

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        d = time.perf_counter() - self._t0
        g = info["generation"]
        self._sums[g] += d
        self._counts[g][bisect.bisect_left(BUCKETS, d)] += 1

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(NAME, "Cyclic GC pauses of this process by generation (the event loop stops "
                                          "for each)", labels=["generation"])
        for g in range(3):
            counts, total, buckets = list(self._counts[g]), 0, []
            for le, n in zip((*(str(b) for b in BUCKETS), "+Inf"), counts, strict=True):
                total += n
                buckets.append((le, total))
            fam.add_metric([str(g)], buckets, self._sums[g])
        yield fam

    def start(self) -> None:
        if self._cb not in gc.callbacks:
            gc.callbacks.append(self._cb)

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._cb)
