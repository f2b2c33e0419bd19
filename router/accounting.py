"""Tier-aware prediction accounting: what the router believed a replica had cached vs what the engine used.

Per request with a usage block, the prediction is split by tier: L0 = the blocks the strategy believes the
chosen replica holds itself (KV events or the router's prefix tree; the engine's own prefix cache, incl. its
CPU offload, i.e. L0/L1 as one), L2 = what l2fs holds beyond that (`--l2fs-master`). Both are capped the way
vLLM caps a hit: whole blocks, and at least the last prompt token is computed. The engine reports one number,
`usage.prompt_tokens_details.cached_tokens` (local prefix cache plus what the KV connector loaded), so:

* totals are exact: precision = sum(min(predicted, actual)) / sum(predicted), recall = sum(min) / sum(actual);
* per tier only the matched part is split, by attribution: the engine looks in its own cache first and asks
  the connector for the rest, so min(predicted, actual) is credited to L0 first, the remainder to L2. That
  gives a precision per tier; a recall per tier would need the actual split per request, which the usage
  block does not carry (vLLM's prefix_cache_hits / external_prefix_cache_hits counters give it only summed
  over all requests of a replica), and L1 (LMCache CPU) vs L2 (l2fs) needs the connector's own counters.
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge

TIERS = ("L0", "L2", "all")


class CacheAccounting:
    """Running sums per tier and the Prometheus series built on them (precision/recall as gauges)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.predicted = dict.fromkeys(TIERS, 0)
        self.matched = dict.fromkeys(TIERS, 0)
        self.actual = 0
        self.requests = 0
        self.last_matched_l2 = 0  # of the latest record(): tokens attributed to loads past the engine's cache
        self.c_pred = Counter("kvtier_router_cache_predicted_tokens",
                              "Prompt tokens predicted cached on the chosen replica, by tier (capped like vLLM)",
                              ["tier"], registry=registry)
        self.c_match = Counter("kvtier_router_cache_matched_tokens",
                               "min(predicted, engine-reported cached tokens), split L0-first by tier",
                               ["tier"], registry=registry)
        self.c_actual = Counter("kvtier_router_cache_actual_tokens",
                                "Engine-reported cached tokens (usage.prompt_tokens_details.cached_tokens)",
                                ["tier"], registry=registry)
        prec = Gauge("kvtier_router_cache_precision", "sum(matched) / sum(predicted) (1 with nothing predicted)",
                     ["tier"], registry=registry)
        for t in TIERS:
            prec.labels(t).set_function(functools.partial(self.precision, t))
        Gauge("kvtier_router_cache_recall", "sum(matched) / sum(actual), all tiers (1 with nothing cached)",
              ["tier"], registry=registry).labels("all").set_function(self.recall)

    @staticmethod
    def cap(tokens: int, n_prompt: int, bs: int) -> int:
        """The most vLLM can report cached for an n-token prompt: whole blocks, the last token recomputed."""
        return max(0, min(tokens // bs * bs, (n_prompt - 1) // bs * bs))

    def record(self, l0: int, l2: int, actual: int, n_prompt: int, block_size: int) -> tuple[int, int, int]:
        """One answered request: l0 = predicted hit on the replica, l2 = the L2 hit length (any overlap
        with l0 is L0's), block_size = the replica's; returns the (L0, L2, all) prediction as counted."""
        p0 = self.cap(l0, n_prompt, block_size)
        p_all = max(p0, self.cap(l2, n_prompt, block_size))
        p2 = p_all - p0
        m_all = min(p_all, actual)
        m0 = min(p0, m_all)
        self.last_matched_l2 = m_all - m0
        for tier, p, m in (("L0", p0, m0), ("L2", p2, m_all - m0), ("all", p_all, m_all)):
            self.predicted[tier] += p
            self.matched[tier] += m
            self.c_pred.labels(tier).inc(p)
            self.c_match.labels(tier).inc(m)
        self.actual += actual
        self.c_actual.labels("all").inc(actual)
        self.requests += 1
        return p0, p2, p_all

    def precision(self, tier: str = "all") -> float:
        return self.matched[tier] / self.predicted[tier] if self.predicted[tier] else 1.0

    def recall(self) -> float:
        return self.matched["all"] / self.actual if self.actual else 1.0


class TierCostCalibrator:
    """Measures what a token loaded from outside the engine's own cache costs, relative to recomputing one.

    Per streamed answer: y = time from sending it to its first chunk (prefill), x1 = tokens the engine
    computed (prompt - cached), x2 = tokens it loaded through the KV connector (the matched L2 part of the
    prediction, as attributed above: only predicted L2 tokens count). A least-squares fit y = a + b1*x1 + b2*x2 over running sums
    gives the per-token times; cost_L2 = b2 / b1, clamped to [0, 1]. Queueing in the engine is noise in y
    (it adds to a, and to b's when it correlates with load), hence many samples and a fit only when both x's
    vary. x2 lumps LMCache's CPU tier (L1) with l2fs (L2): the usage block cannot tell them apart.
    """

    def __init__(self, min_samples: int = 64) -> None:
        self.min_samples = min_samples
        self.n = 0
        self._s = [[0.0] * 4 for _ in range(3)]  # normal equations [X'X | X'y] for columns (1, x1, x2)

    def add(self, seconds: float, computed: int, loaded: int) -> None:
        row = (1.0, float(computed), float(loaded))
        for i in range(3):
            for j in range(3):
                self._s[i][j] += row[i] * row[j]
            self._s[i][3] += row[i] * seconds
        self.n += 1

    def l2_cost(self) -> float | None:
        """The fitted cost, or None while there are too few samples or x1/x2 do not vary independently."""
        if self.n < self.min_samples:
            return None
        m = [r[:] for r in self._s]
        for c in range(3):  # Gauss-Jordan with partial pivoting on the 3x3 system
            p = max(range(c, 3), key=lambda r: abs(m[r][c]))
            if abs(m[p][c]) < 1e-9 * max(1.0, abs(self._s[c][c])):
                return None
            m[c], m[p] = m[p], m[c]
            for r in range(3):
                if r != c:
                    f = m[r][c] / m[c][c]
                    m[r] = [a - f * b for a, b in zip(m[r], m[c], strict=True)]
        b1, b2 = m[1][3] / m[1][1], m[2][3] / m[2][2]
        if b1 <= 0:
            return None
        return min(1.0, max(0.0, b2 / b1))
