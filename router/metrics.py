"""Prometheus metrics of one router instance (own registry, so several routers can live in one process)."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FAST_BUCKETS = (  # also the GC pause histogram's (router.gcpause)
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvtier_router_requests", "Proxied requests by final status",
                                ["replica", "strategy", "code"], registry=r)
        self.decisions = Counter("kvtier_router_decisions", "Routing decisions by reason",
                                 ["strategy", "reason"], registry=r)
        self.retries = Counter("kvtier_router_retries", "Retries on another replica before the first byte",
                               ["reason"], registry=r)
        self.cancelled = Counter("kvtier_router_client_disconnects", "Client disconnects propagated upstream",
                                 ["phase"], registry=r)
        self.rejected = Counter("kvtier_router_rejected", "Requests rejected by the router", ["reason"], registry=r)
        self.overhead = Histogram("kvtier_router_overhead_seconds",
                                  "Router time before the upstream send, tokenization excluded", buckets=FAST_BUCKETS,
                                  registry=r)
        self.tokenize = Histogram("kvtier_router_tokenize_seconds", "Prompt tokenization time", buckets=FAST_BUCKETS,
                                  registry=r)
        self.l2_lookups = Counter("kvtier_router_l2_lookups",
                                  "kvaware's L2 presence lookups by result (hit, miss, failed = error or past "
                                  "--l2fs-timeout, skipped = no answer could change the pick)", ["result"],
                                  registry=r)
        self.tokenize_fallback = Counter("kvtier_router_tokenize_fallback",
                                         "Requests routed by bytes because the replica /tokenize failed", registry=r)
        self.ttfb = Histogram("kvtier_router_upstream_first_byte_seconds", "Upstream time to first byte",
                              registry=r)
        self.predicted_cached = Counter("kvtier_router_predicted_cached_tokens",
                                        "Prompt tokens predicted to hit L0/L1 on the chosen replica", registry=r)
        self.actual_cached = Counter("kvtier_router_actual_cached_tokens",
                                     "usage.prompt_tokens_details.cached_tokens reported back", registry=r)
        self.prompt_tokens = Counter("kvtier_router_prompt_tokens", "Prompt tokens routed", registry=r)
        self.inflight = Gauge("kvtier_router_inflight", "In-flight requests per replica", ["replica"], registry=r)
        self.inflight_prefill = Gauge("kvtier_router_inflight_prefill_tokens", "Admitted uncached prefill tokens",
                                      ["replica"], registry=r)
        self._load_children: dict[str, tuple[Gauge, Gauge]] = {}
        self.external = Gauge("kvtier_router_replica_external_requests",
                              "Other routers' requests on a replica (its vLLM load gauges minus ours, last scrape)",
                              ["replica", "state"], registry=r)
        self.tier_cost = Gauge("kvtier_router_tier_cost", "Routing cost of one cached token per tier (recompute = 1)",
                               ["tier"], registry=r)
        self.queue_depth = Gauge("kvtier_router_queue_depth", "Requests waiting in the admission queue", registry=r)
        self.queue_depth_max = Gauge("kvtier_router_queue_depth_max", "Highest admission queue depth seen",
                                     registry=r)
        self.admitted = Gauge("kvtier_router_admitted", "Requests past the admission gate, not yet finished",
                              registry=r)
        self.healthy = Gauge("kvtier_router_replica_up", "1 if the replica takes traffic", ["replica"], registry=r)
        self.kv_events = Counter("kvtier_router_kv_events", "KV events applied (and gaps/replays/purges)",
                                 ["replica", "type"], registry=r)
        self.kv_dropped = Counter("kvtier_router_kv_events_dropped", "Malformed KV events skipped (not indexed)",
                                  ["replica"], registry=r)
        self.kv_blocks = Gauge("kvtier_router_kv_index_blocks", "Blocks in the KV-event index", registry=r)
        self.tree_blocks = Gauge("kvtier_router_prefix_tree_blocks", "Blocks in the approximate prefix tree",
                                 registry=r)
        self.l2_key_check = Gauge("kvtier_router_l2_key_check",
                                  "Installed LMCache's chunk keys vs kvtier.contract: 1 for the current state "
                                  "(pending, ok, drift = no L2 credit, unverified)", ["state"], registry=r)
        self.gc_frozen = Gauge("kvtier_router_gc_frozen_objects",
                               "Objects in the permanent generation (the start-up heap, frozen once serving)",
                               registry=r)
        self.gc_frozen.set_function(gc.get_freeze_count)
        self.kv_lag = Gauge("kvtier_router_kv_event_lag_seconds", "Latest event-to-index lag", ["replica"],
                            registry=r)

    def replica_load(self, url: str) -> tuple[Gauge, Gauge]:
        """The (inflight, inflight_prefill) children of one replica, looked up once: every request sets both
        twice, and a labels() lookup per set was ~4 % of the picker's CPU at 400 req/s (py-spy)."""
        got = self._load_children.get(url)
        if got is None:
            got = self._load_children[url] = (self.inflight.labels(url), self.inflight_prefill.labels(url))
        return got
