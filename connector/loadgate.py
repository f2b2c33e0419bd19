"""Never slower than recompute: claim L2 chunks only while loading them beats prefilling them.

Why: a storage hit that loses to recompute is a known failure of tiered KV caches (a throttled worker, a
loaded link, a busy disk). LMCache asks the connector how many leading chunks it holds and then *waits* for
them; once a chunk is claimed the engine does not recompute it. So the connector decides at claim time:

    load time of n chunks   = n * bytes_per_token * chunk_tokens / L2 rate
    recompute time          = n * chunk_tokens / prefill rate

Both grow with n, so the rule is per replica, not per prompt: claim while
`L2 rate >= margin * bytes_per_token * prefill rate`, else report 0 hits (the engine recomputes, as on a miss).

* L2 rate: an EWMA of (bytes loaded, wall seconds) over the connector's batched loads (the whole batch,
  locate + parallel reads; a read that times out adds its wait with 0 bytes), rate = bytes / seconds of the
  two averages. Unknown (no load yet) = claim.
* Prefill rate: a configured figure (tokens/s: `remote_storage_plugin.l2fs.prefill_tokens_per_s` or
  `$KVTIER_PREFILL_TOKENS_PER_S`). Not measured: the plugin boundary sees keys and bytes, not the engine's
  forward passes. Unset or 0 = the gate is off (every hit is claimed, the old behaviour).
* While closed no real load measures L2, so every `probe_interval` seconds a background probe re-reads the
  last loaded batch (same paths, same parallelism) and feeds the average; the gate reopens when it is fast.
* Decided before the load, not after it: the average only learns that L2 slowed from loads that were already
  slow, so the first requests after a slow-down used to pay for it (~1 s each at 2k tokens). While the gate is
  open, each claim first reads the first chunk it claims, with a deadline of `precheck_share` (10 %) of the
  time recomputing the claimed chunks would take (`precheck_budget`). Missed deadline or a rate below the bar:
  this claim is dropped (the engine recomputes, having lost at most that 10 %), and the sample replaces the
  average, so the gate closes for the claims that follow until the background probe finds L2 fast again.
  Met: claimed, and the connector keeps the bytes, so the load that follows reads that chunk from memory
  instead of twice (healthy L2 pays only for reading one chunk ahead of the rest).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("kvtier.connector.loadgate")

try:  # same registry as the connector's other metrics (connector.fingerprint): the process default
    from prometheus_client import Counter, Gauge

    RATE: Any = Gauge("kvtier_l2_load_bytes_per_second",
                      "Running (EWMA) estimate of this replica's L2 load rate; 0 until a load was measured")
    GATE_OPEN: Any = Gauge("kvtier_l2_claims_open", "1 while L2 loads beat recompute (hits are claimed), else 0")
    GATED: Any = Counter("kvtier_l2_gated_chunks", "L2 chunks not claimed because loading them was slower "
                         "than recomputing them")
except Exception:  # noqa: BLE001 - duplicate registration or no prometheus_client
    RATE = GATE_OPEN = GATED = None


class LoadGate:
    """Running L2 load-rate estimate vs the engine's prefill rate (see module doc). Thread-safe."""

    def __init__(self, bytes_per_token: float, prefill_tokens_per_s: float = 0.0, *, alpha: float = 0.3,
                 margin: float = 1.0, probe_interval: float = 5.0, stall_s: float = 0.5,
                 precheck_share: float = 0.1) -> None:
        self.bytes_per_token = float(bytes_per_token)
        self.precheck_share = float(precheck_share)  # 0 = no check before a claim (decide on the average only)
        self.prefill_tps = float(prefill_tokens_per_s or 0.0)
        self.alpha, self.margin, self.probe_interval = alpha, margin, probe_interval
        self.stall_s = stall_s  # a load or probe this slow counts even when it delivered nothing
        self._bytes: float | None = None
        self._secs: float | None = None
        self._open = True
        self._last_probe = 0.0
        self._probing = False
        self.probes = 0
        self.probe_paths: list[str] = []  # the last loaded batch (up to 8 files): what a probe re-reads
        self._lock = threading.Lock()
        if GATE_OPEN is not None:
            GATE_OPEN.set(1)

    @property
    def enabled(self) -> bool:
        return self.prefill_tps > 0 and self.bytes_per_token > 0

    @property
    def needed_rate(self) -> float:
        """Bytes/s at which loading a chunk takes as long as recomputing it (times the margin)."""
        return self.margin * self.bytes_per_token * self.prefill_tps

    @property
    def rate(self) -> float | None:
        """EWMA load rate in bytes/s; None before the first sample."""
        with self._lock:
            if self._bytes is None or not self._secs:
                return None
            return self._bytes / self._secs

    def observe(self, nbytes: int, seconds: float) -> None:
        """One load batch: bytes it delivered and the wall time it took (failures add time, not bytes)."""
        if seconds <= 0:
            return
        with self._lock:
            if self._bytes is None or self._secs is None:
                self._bytes, self._secs = float(nbytes), float(seconds)
            else:
                a = self.alpha
                self._bytes = (1 - a) * self._bytes + a * nbytes
                self._secs = (1 - a) * self._secs + a * seconds
            rate = self._bytes / self._secs
        if RATE is not None:
            RATE.set(rate)
        self._decide(rate)

    def forget(self) -> None:
        """No estimate any more (a probe found nothing to read): claim again and let real loads measure."""
        with self._lock:
            self._bytes = self._secs = None
        self._decide(None)

    def _decide(self, rate: float | None) -> None:
        is_open = not self.enabled or rate is None or rate >= self.needed_rate
        with self._lock:
            was, self._open = self._open, is_open
        if GATE_OPEN is not None:
            GATE_OPEN.set(1 if is_open else 0)
        if was != is_open and self.enabled:
            shown = "unknown" if rate is None else f"{rate / 1e6:.1f} MB/s"
            if is_open:
                log.warning("kvtier: L2 loads beat recompute again (%s >= %.1f MB/s): claiming L2 hits",
                            shown, self.needed_rate / 1e6)
            else:
                log.warning("kvtier: L2 loads slower than recompute (%s < %.1f MB/s needed at %.0f tokens/s "
                            "prefill): not claiming L2 hits, probing every %.0f s", shown,
                            self.needed_rate / 1e6, self.prefill_tps, self.probe_interval)

    def precheck_budget(self, claimed_bytes: int) -> float:
        """Seconds a check before claiming `claimed_bytes` may take: precheck_share of recomputing them."""
        if not self.enabled or self.precheck_share <= 0:
            return 0.0
        return self.precheck_share * claimed_bytes / (self.bytes_per_token * self.prefill_tps)

    def prechecked(self, nbytes: int | None, seconds: float, budget: float) -> bool:
        """The check before a claim read `nbytes` (None: nothing arrived) in `seconds`: claim? A chunk that
        came within the budget at a rate that beats recompute is claimed; one that missed the deadline is a
        stall sample (as a stalled load), so the gate closes for the claims that follow."""
        if nbytes is None and seconds < min(budget, self.stall_s) * 0.9:
            return False  # a quick miss (evicted since the lookup, a fault): says nothing about the rate
        got, secs = float(nbytes or 0), max(seconds, 1e-9)
        rate = got / secs
        ok = nbytes is not None and seconds <= budget and rate >= self.needed_rate
        if ok:
            self.observe(nbytes or 0, seconds)
        else:  # what L2 does now replaces the average: the gate closes, the background probe reopens it
            with self._lock:
                self._bytes, self._secs = got, secs
            if RATE is not None:
                RATE.set(rate)
            self._decide(rate)
        return ok

    def allow(self) -> bool:
        """Claim L2 hits now?"""
        return self._open

    def gated(self, chunks: int) -> None:
        if GATED is not None and chunks > 0:
            GATED.inc(chunks)

    def start_probe(self) -> bool:
        """True when the caller should run a probe now (closed, interval passed, none running)."""
        now = time.monotonic()
        with self._lock:
            if self._open or self._probing or now - self._last_probe < self.probe_interval:
                return False
            self._probing, self._last_probe = True, now
            return True

    def probe_done(self) -> None:
        with self._lock:
            self._probing = False

    def loaded(self, nbytes: int, seconds: float, hit_paths: Sequence[str]) -> None:
        """One load batch. An all-miss batch that came back fast says nothing about the rate; a slow one
        (a stalled worker: >= stall_s) counts with its bytes, maybe 0. Its first 8 hits are what a probe
        re-reads."""
        if nbytes or seconds >= self.stall_s:
            self.observe(nbytes, seconds)
        if hit_paths:
            self.probe_paths = list(hit_paths[:8])

    def claiming(self, client: Any, file_size: int, may_probe: bool = True) -> bool:
        """allow(); when closed, start a background probe if one is due (and L2 may be touched now)."""
        if self.allow():
            return True
        if may_probe and self.start_probe():
            threading.Thread(target=self._probe, args=(client, file_size), name="kvtier-l2-rate-probe",
                             daemon=True).start()
        elif not may_probe:
            self.forget()  # no probe possible (L2 unreachable: its own breaker answers misses); measure anew
        return False

    def _probe(self, client: Any, size: int) -> None:
        """Re-read the last loaded batch, in parallel like a load, as one sample. One sample per probe
        interval (not a burst): a bursty L2 (a worker that stalls and catches up) is then sampled in
        proportion to time, as requests would sample it, and a short good moment does not reopen the gate.
        Recovery takes a few intervals while the average catches up."""
        try:
            paths = list(self.probe_paths)
            if not paths:
                self.forget()  # nothing to measure with: claim again, the next real load measures
                return

            def read(path: str) -> tuple[int, bool]:
                try:
                    n = client.get_into(path, bytearray(size))
                    return (n or 0), n is not None
                except Exception:  # noqa: BLE001 - a timeout: time spent, no bytes
                    return 0, True

            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(paths), thread_name_prefix="kvtier-l2-probe") as ex:
                got = list(ex.map(read, paths))
            dt = time.perf_counter() - t0
            self.probes += 1
            if not any(found for _, found in got) and dt < self.stall_s:
                self.forget()  # evicted since: no sample (a slow "not found" is a stalled worker: a sample)
            else:
                self.observe(sum(n for n, _ in got), dt)
        except Exception as e:  # noqa: BLE001 - a probe never raises
            log.debug("L2 rate probe failed: %s", e)
        finally:
            self.probe_done()
