"""The router's state stays out of CPython's cyclic GC: what a full collection walks does not grow with it.

Why: a full collection stops the event loop and walks every tracked container. A kvaware router at 400 req/s
paused 21-51 ms per full collection (the e2e p99 of such runs): the tokenizer cache's 4,096 id lists, every new
prefix-tree block's dict ((generation, expiry) tuple values), the KV index's maps created empty after start-up.
Now the start-up heap is frozen once the router serves (router.gcpause; the CLI path is checked in
test_router_proxy.test_models_health_metrics) and the state keeps atomic values or lives in containers frozen
with it (docs/results/2026-12-04-router-gc.md).
"""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from router.app import Router, RouterConfig
from router.policy import Policy
from router.replicas import Replica
from router.tokens import Tokenizer

pytestmark = pytest.mark.unit

URLS = [f"http://10.0.0.{i}:8000" for i in range(4)]


@pytest.fixture
def frozen() -> Iterator[None]:
    """A process that froze its heap (as the router does once it serves); unfrozen after the test."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _walked() -> tuple[int, int]:
    """Tracked objects outside the permanent generation, and the entries of those that are containers:
    roughly what the next full collection walks."""
    objs = gc.get_objects()
    entries = sum(len(o) for o in objs if isinstance(o, (list, dict, set, tuple)))
    return len(objs), entries


def _serve(policy: Policy, tok: Tokenizer, reps: list[Replica], rng: random.Random, n: int, base: int) -> None:
    """n chat prompts through what a kvaware/prefixaware router keeps per request: tokenizer cache, prefix tree,
    speculative tree and the KV-event index."""
    systems = ["".join(rng.choice("abcdefgh ") for _ in range(1500)) for _ in range(4)]
    for i in range(base, base + n):
        body = {"messages": [{"role": "system", "content": systems[i % 4]},
                             {"role": "user", "content": f"question {i} " * 20}]}
        ids = tok.encode("chat", body)
        for strategy in ("prefixaware", "kvaware"):
            d = policy.choose(strategy, reps, ids)
            policy.record(strategy, d)
        r = reps[i % 4].url
        full = len(ids) // 16 * 16
        policy.kv.stored(r, [hash((r, i, b)) for b in range(full // 16)], None, ids[:full], 16, "GPU")


def test_state_growth_adds_nothing_a_full_collection_walks(frozen: None) -> None:
    reps = [Replica(u) for u in URLS]
    policy = Policy(block_size=16)
    tok = Tokenizer("bytes", cache_entries=4096)
    for u in URLS:
        policy.kv.add(u)  # what the router does for each replica with KV events, before it serves
    gc.collect()
    gc.freeze()  # the router's start-up freeze, with its (empty) state in it
    rng = random.Random(7)
    _serve(policy, tok, reps, rng, 50, 0)
    gc.collect(1)
    objs0, entries0 = _walked()
    _serve(policy, tok, reps, rng, 400, 50)
    gc.collect(1)  # young collections run all the time; they untrack tuples of atoms
    objs1, entries1 = _walked()
    assert len(policy.tree) > 8_000 and len(policy.kv) > 8_000 and len(tok._cache) == 450
    # 400 more prompts (~0.8 M cached ids, thousands more blocks in each index): nothing in them is walked
    # (before: +710 objects, 99 k -> 876 k entries, the cache's id lists and the index maps born after the freeze)
    assert objs1 - objs0 < 50, (objs0, objs1)
    assert entries1 - entries0 < 1_000, (entries0, entries1)


def test_tokenizer_hands_out_copies_of_its_cache() -> None:
    tok = Tokenizer("bytes")
    body = {"prompt": "hello world"}
    a = tok.encode("completion", body)
    a.append(0)  # a caller changing its ids cannot change what the next request gets
    assert tok.encode("completion", body) == list(b"hello world") == tok.cached("completion", body)


def test_pause_metric_takes_no_lock_a_scrape_may_hold() -> None:
    """A collection starts at any allocation, in any thread, also inside a scrape that holds prometheus_client's
    locks; a pause callback that took one of them (as Histogram.labels().observe() does) would hang that thread.
    With every metric lock of a router's registry held elsewhere, a collection's callback still completes."""
    router = Router(RouterConfig(replicas=["http://127.0.0.1:9"]))
    router.gc_pauses.start()
    held: list[threading.Lock] = []
    for collector in list(router.m.registry._collector_to_names):
        for obj in (collector, *getattr(collector, "_metrics", {}).values()):
            lock = getattr(obj, "_lock", None)
            if lock is not None and lock.acquire(timeout=1):
                held.append(lock)
    collected = threading.Event()
    try:
        assert held  # the registry's metrics do have locks
        t = threading.Thread(target=lambda: (gc.collect(), collected.set()), daemon=True)
        t.start()
        t.join(10)
    finally:
        for lock in held:
            lock.release()
        router.gc_pauses.stop()
    assert collected.is_set(), "the GC pause callback waited on a metric lock"
    text = generate_latest(router.m.registry).decode()
    assert 'kvtier_router_gc_pause_seconds_count{generation="2"}' in text
    assert 'kvtier_router_gc_pause_seconds_bucket{generation="2",le="+Inf"}' in text
