"""`kvtier bench cross-pod --throttle-l2 SPEC`: is an L2 hit ever slower than recomputing?

Per length, `--reps` interleaved repetitions of: A stores a fresh prompt P (L2 healthy); the throttle goes on;
B requests P (the L2 arm: B never saw P, its hit can only come from L2, from the worker holding A's chunks);
B requests a fresh prompt Q nobody stored (the cold arm); the throttle goes off. The healthy phase runs the
same steps without the throttle first (all lengths), then the throttled phase (all lengths), so the load gate
state of one phase never leaks into the other's first requests. Reported per length and phase: medians of
both arms, the ratio L2 arm / min(cold arm, healthy L2 hit) (goal <= 1.10x), and how many B requests of P the
gate declined (LMCache hit tokens 0: recomputed although the chunks were in L2).

Two ratios: the brief's L2 arm / min(cold arm, healthy L2 hit), and the goal's L2 arm / min(cold,
L2 hit) in the same conditions: min(the phase's cold arm, the phase's claimed L2 hits). Under a throttle a
healthy-speed L2 hit is not on offer, so the first ratio stays well above 1 even when every slow hit is
declined; the second is 1.0 when the gate picks the faster of recompute and the (throttled) load every time.

Throttles (on the l2fs worker of A's node, which holds A's chunks: placement is local-first):
  stop:ON/OFF   SIGSTOP for ON s, SIGCONT for OFF s, repeated (a worker that stalls: GC, a busy disk, a
                noisy neighbour); works on loopback and --netns; the worker is always left running
  rate:RATE     tc rate of A's node link (--netns only, `l2fs.testing.netns` set_rate, as `kvtier chaos rate`);
                restored to the stack's --link afterwards
The throttle is on for `lead` seconds (two periods for stop, 0.5 s for rate) before B's first request.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvtier.bench.common import fmt, pct, table
from kvtier.up import log

PHASES = ("healthy", "throttled")
TARGET = 1.10  # the goal: the L2 arm's median <= 1.10x min(cold, L2 hit)


@dataclass(frozen=True)
class ThrottleSpec:
    kind: str  # "stop" | "rate"
    on_s: float = 0.0
    off_s: float = 0.0
    rate: str = ""

    @property
    def lead_s(self) -> float:
        return 2 * (self.on_s + self.off_s) if self.kind == "stop" else 0.5

    def __str__(self) -> str:
        return f"stop:{self.on_s:g}/{self.off_s:g}" if self.kind == "stop" else f"rate:{self.rate}"


def parse_throttle(spec: str) -> ThrottleSpec:
    """'stop:2.7/0.3' or 'rate:20mbit' -> ThrottleSpec; ValueError with the accepted forms otherwise."""
    kind, _, arg = spec.partition(":")
    if kind == "stop":
        try:
            on, off = (float(x) for x in arg.split("/"))
        except ValueError:
            raise ValueError(f"--throttle-l2 {spec!r}: stop:ON/OFF seconds, e.g. stop:2.7/0.3") from None
        if on <= 0 or off <= 0:
            raise ValueError(f"--throttle-l2 {spec!r}: both durations must be > 0 (a worker never resumed "
                             "is an outage, not a throttle)")
        return ThrottleSpec("stop", on, off)
    if kind == "rate":
        from l2fs.testing.netns import NetnsError, parse_rate

        try:
            parse_rate(arg)
        except (NetnsError, ValueError) as e:
            raise ValueError(f"--throttle-l2 {spec!r}: {e}") from None
        return ThrottleSpec("rate", rate=arg)
    raise ValueError(f"--throttle-l2 {spec!r}: stop:ON/OFF (seconds) or rate:RATE (--netns), "
                     "e.g. stop:2.7/0.3 or rate:20mbit")


class Throttle:
    """Turns the spec on and off around B's requests on the stack started by the bench."""

    def __init__(self, spec: ThrottleSpec, stack: Any, node: str) -> None:
        self.spec, self.node, self.net = spec, node, stack.net
        workers = [w for w in stack.cluster.workers if w.node_id == node]
        if not workers:
            raise ValueError(f"no l2fs worker on {node}")
        self.worker = workers[0]
        if spec.kind == "rate" and self.net is None:
            raise ValueError("--throttle-l2 rate:... shapes a node link: needs --netns")
        self.base_rate = stack.link
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _signal(self, sig: int) -> None:
        from l2fs.testing.netns import NetnsCluster

        NetnsCluster.signal(self.worker.proc, sig)

    def _duty(self) -> None:
        try:
            while not self._stop.is_set():
                self._signal(signal.SIGSTOP)
                if self._stop.wait(self.spec.on_s):
                    break
                self._signal(signal.SIGCONT)
                self._stop.wait(self.spec.off_s)
        finally:
            self._signal(signal.SIGCONT)

    def on(self) -> None:
        if self.spec.kind == "rate":
            self.net.set_rate(self.node, self.spec.rate)
        else:
            self._stop.clear()
            self._thread = threading.Thread(target=self._duty, name="kvtier-throttle", daemon=True)
            self._thread.start()
        time.sleep(self.spec.lead_s)

    def off(self) -> None:
        if self.spec.kind == "rate":
            self.net.set_rate(self.node, self.base_rate)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
            self._thread = None
            self._signal(signal.SIGCONT)  # whatever happened in the thread: the worker runs again


def run_throttled(a: Any, b: Any, model: str, prompts: Any, lengths: list[int], reps: int, probe: Any,
                  throttle: Throttle) -> list[dict[str, Any]]:
    """The healthy phase, then the throttled one (see module doc); one raw row per request."""
    from kvtier.bench.cross_pod import request

    raw: list[dict[str, Any]] = []
    for phase in PHASES:
        for n in lengths:
            for rep in range(reps):
                base = {"phase": phase, "throttle": str(throttle.spec), "prompt_tokens": n, "rep": rep}
                p, q = prompts.make(n), prompts.make(n)
                probe.start_row()
                row, _ = request(a, model, p, probe)
                raw.append({**base, "arm": "store A", **row, **probe.wait_stored(n)})
                if phase == "throttled":
                    throttle.on()
                try:
                    for arm, prompt in (("L2 arm B", p), ("cold arm B", q)):
                        row, _ = request(b, model, prompt, probe)
                        hit = row.get("lmcache_hit_tokens")
                        raw.append({**base, "arm": arm, **row,
                                    "gated": arm == "L2 arm B" and hit is not None and hit == 0})
                finally:
                    if phase == "throttled":
                        throttle.off()
                l2, cold = raw[-2], raw[-1]
                log(f"{phase} {n:>5} tok rep {rep}: L2 arm {l2['ttft_ms']:.0f} ms (LMCache hit "
                    f"{l2.get('lmcache_hit_tokens')}), cold arm {cold['ttft_ms']:.0f} ms")
    return raw


def summarize_throttled(raw: list[dict[str, Any]], lengths: list[int]) -> tuple[list[dict[str, Any]], str]:
    """Per length and phase: medians, the ratio to min(cold, healthy L2 hit), declined claims."""
    rows, out = [], []
    for n in lengths:
        def ttfts(phase: str, arm: str, n: int = n) -> list[float]:
            return [r["ttft_ms"] for r in raw if r["prompt_tokens"] == n and r["phase"] == phase and r["arm"] == arm]

        healthy_l2 = pct(ttfts("healthy", "L2 arm B"), 50)
        for phase in PHASES:
            l2s = [r for r in raw if r["prompt_tokens"] == n and r["phase"] == phase and r["arm"] == "L2 arm B"]
            if not l2s:
                continue
            l2, cold = pct(ttfts(phase, "L2 arm B"), 50), pct(ttfts(phase, "cold arm B"), 50)
            hits = [r["lmcache_hit_tokens"] for r in l2s if r.get("lmcache_hit_tokens") is not None]
            claimed = pct([r["ttft_ms"] for r in l2s if not r.get("gated")], 50)
            best = min(cold, claimed) if claimed == claimed else cold  # nan: every hit declined
            s = {"prompt_tokens": n, "phase": phase, "reps": len(l2s), "l2_arm_p50_ms": l2, "cold_arm_p50_ms": cold,
                 "healthy_l2_p50_ms": healthy_l2, "ratio_to_best": l2 / min(cold, healthy_l2),
                 "claimed_l2_p50_ms": claimed, "ratio_same_phase": l2 / best,
                 "gated": sum(1 for r in l2s if r.get("gated")), "b_hit_tokens_min": min(hits) if hits else None,
                 "b_hit_tokens_max": max(hits) if hits else None,
                 "store_a_p50_ms": pct(ttfts(phase, "store A"), 50)}
            rows.append(s)
            out.append([n, phase, s["reps"], fmt(l2, 0), fmt(cold, 0), fmt(healthy_l2, 0),
                        fmt(s["ratio_to_best"], 2) + "x", fmt(claimed, 0), fmt(s["ratio_same_phase"], 2) + "x",
                        f"{s['gated']}/{s['reps']}",
                        f"{fmt(s['b_hit_tokens_min'], 0)}-{fmt(s['b_hit_tokens_max'], 0)}",
                        fmt(s["store_a_p50_ms"], 0)])
    text = table(["tokens", "phase", "reps", "L2 arm p50", "cold arm p50", "healthy L2 p50",
                  "L2/min(cold, healthy L2)", "claimed L2 p50", "L2/min(cold, claimed L2)", "gated", "B hit tok", "A store p50"], out,
                 title="B's TTFT (ms) with L2 on a throttled worker vs recompute (L2 arm: A's prompt, only in L2; "
                 "cold arm: a fresh prompt; gated = the load gate declined the L2 hit, LMCache hit tokens 0)")
    return rows, text


def goal_line(rows: list[dict[str, Any]]) -> str:
    thr = [r for r in rows if r["phase"] == "throttled"]
    if not thr:
        return "goal: no throttled rows"
    worst = max(thr, key=lambda r: r["ratio_same_phase"])
    brief = max(thr, key=lambda r: r["ratio_to_best"])
    healthy_gated = sum(r["gated"] for r in rows if r["phase"] == "healthy")
    return (f"goal: throttled L2 arm <= {TARGET:.2f}x min(cold, L2 hit) of the same phase at every length -> worst "
            f"{fmt(worst['ratio_same_phase'], 2)}x at {worst['prompt_tokens']} "
            f"({'met' if worst['ratio_same_phase'] <= TARGET else 'NOT met'}); against the healthy L2 hit: worst "
            f"{fmt(brief['ratio_to_best'], 2)}x at {brief['prompt_tokens']}; healthy phase: {healthy_gated} "
            "hit(s) declined (nothing should change with L2 healthy)")
