"""Routing strategies against real test-replica processes (real KV events over ZMQ)."""

from __future__ import annotations

import threading
from collections import Counter

from router_helpers import complete, metric, wait_until

SYS = "You are a helpful assistant. Answer briefly and precisely, citing sources when you can. " * 3


def test_prefixaware_sends_repeated_prefix_to_its_replica_and_hits(cluster):
    reps = [cluster.replica(kv=False) for _ in range(3)]
    rt = cluster.router(reps, "--strategy", "prefixaware")
    owners = {}
    for doc in range(3):
        prompt = f"document {doc}: " + ("lorem ipsum dolor sit amet " * 8)
        first = complete(rt, prompt + "question 0")
        owners[doc] = first.headers["x-kvtier-replica"]
        for q in range(1, 4):
            r = complete(rt, prompt + f"question {q}")
            assert r.headers["x-kvtier-replica"] == owners[doc]
            assert r.headers["x-kvtier-route"] == "cache_hit"
            usage = r.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 16


def test_roundrobin_spreads_evenly(cluster):
    reps = [cluster.replica(kv=False) for _ in range(3)]
    rt = cluster.router(reps, "--strategy", "roundrobin")
    got = Counter(complete(rt, "same prompt").headers["x-kvtier-replica"] for _ in range(9))
    assert sorted(got.values()) == [3, 3, 3]


def test_per_request_strategy_header_overrides_default(cluster):
    reps = [cluster.replica(kv=False) for _ in range(2)]
    rt = cluster.router(reps, "--strategy", "roundrobin")
    hdr = {"X-Kvtier-Strategy": "prefixaware"}
    prompt = "a shared prefix that is longer than one block of sixteen bytes " * 2
    owner = complete(rt, prompt, headers=hdr).headers["x-kvtier-replica"]
    for _ in range(4):
        assert complete(rt, prompt, headers=hdr).headers["x-kvtier-replica"] == owner
    assert metric(rt, "kvtier_router_decisions_total", strategy="prefixaware", reason="cache_hit") == 4


def test_kvaware_follows_real_kv_events_not_router_memory(cluster):
    a, b = cluster.replica(), cluster.replica("--encoding", "array")
    rt = cluster.router([a, b], "--strategy", "kvaware", kv=True)
    prompt = "warm this prefix directly on the replica, bypassing the router entirely. " * 3
    # b (array-encoded events, the older wire format) and a (map-encoded) both get warmed directly
    for rep, p in ((b, prompt + "B"), (a, "other " + prompt)):
        r = rep.post("/v1/completions", json={"model": "test-model", "prompt": p, "max_tokens": 1})
        assert r.status_code == 200
    wait_until(lambda: metric(rt, "kvtier_router_kv_events_total", type="BlockStored") >= 2)
    for i in range(3):
        r = complete(rt, prompt + f"B and more {i}")
        assert r.headers["x-kvtier-replica"] == b.url and r.headers["x-kvtier-route"] == "cache_hit"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 16
    r = complete(rt, "other " + prompt + "A")
    assert r.headers["x-kvtier-replica"] == a.url
    # predicted vs actual cached tokens are exported
    assert metric(rt, "kvtier_router_actual_cached_tokens_total") > 0
    assert metric(rt, "kvtier_router_predicted_cached_tokens_total") > 0


def test_kvaware_reset_and_eviction_events_update_the_index(cluster):
    a = cluster.replica("--capacity-blocks", "12")
    b = cluster.replica()
    rt = cluster.router([a, b], "--strategy", "kvaware", kv=True)
    prompt = "x" * 160  # 10 blocks
    a.post("/v1/completions", json={"model": "test-model", "prompt": prompt, "max_tokens": 1})
    wait_until(lambda: metric(rt, "kvtier_router_kv_index_blocks") == 10)
    # eviction: 10 more blocks into a 12-block cache -> BlockRemoved for the oldest 8
    a.post("/v1/completions", json={"model": "test-model", "prompt": "y" * 160, "max_tokens": 1})
    wait_until(lambda: metric(rt, "kvtier_router_kv_events_total", type="BlockRemoved") == 1)
    wait_until(lambda: metric(rt, "kvtier_router_kv_index_blocks") == 12)
    # AllBlocksCleared (vLLM's /reset_prefix_cache) empties that replica's part of the index
    a.post("/reset_prefix_cache")
    wait_until(lambda: metric(rt, "kvtier_router_kv_index_blocks") == 0)
    assert metric(rt, "kvtier_router_kv_events_total", type="AllBlocksCleared") == 1


def test_kvaware_sequence_gap_is_replayed_or_purged(cluster):
    a = cluster.replica()
    b = cluster.replica()
    rt = cluster.router([a, b], "--strategy", "kvaware", kv=True)

    def warm(rep, text):
        rep.post("/v1/completions", json={"model": "test-model", "prompt": text, "max_tokens": 1})

    warm(a, "first " * 10)
    wait_until(lambda: metric(rt, "kvtier_router_kv_index_blocks") == 3)
    a.post("/admin/drop_events", json={"n": 2})  # the next two batches never reach the subscriber
    warm(a, "second " * 10)
    warm(a, "third " * 10)
    warm(a, "fourth " * 10)  # arrives with a seq gap -> replay from the ROUTER socket
    wait_until(lambda: metric(rt, "kvtier_router_kv_events_total", type="replay") == 1)
    assert metric(rt, "kvtier_router_kv_events_total", type="gap") == 1
    wait_until(lambda: metric(rt, "kvtier_router_kv_index_blocks") == 3 + 4 + 3 + 4)
    r = complete(rt, "second " * 10 + "tail")
    assert r.headers["x-kvtier-replica"] == a.url and r.headers["x-kvtier-route"] == "cache_hit"
    # now the replay buffer only keeps one batch: a gap cannot be filled -> the replica is purged
    a.post("/admin/drop_events", json={"n": 3, "buffer_steps": 1})
    for w in ("fifth ", "sixth ", "seventh ", "eighth "):
        warm(a, w * 10)
    wait_until(lambda: metric(rt, "kvtier_router_kv_events_total", type="purge:gap") == 1)
    # after the purge only what arrived since is known: the "eighth" batch, 70 bytes = 4 blocks
    wait_until(lambda: metric(rt, "kvtier_router_kv_index_blocks") == 4)


def test_load_cap_spreads_a_hot_shared_prompt(cluster):
    reps = [cluster.replica("--decode-ms-per-token", "100", kv=False) for _ in range(4)]
    rt = cluster.router(reps, "--strategy", "prefixaware", "--load-epsilon", "0.25")
    hot = SYS + "what time is it?"
    complete(rt, hot)  # warm one replica
    results = []

    def go(i: int) -> None:
        results.append(complete(rt, hot + f" user {i}", max_tokens=10).headers["x-kvtier-replica"])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    per = Counter(results)
    maxin = max(r.get("/admin/stats").json()["max_inflight"] for r in reps)
    # 16 concurrent requests over 4 replicas: the hot replica may take a little more, never all
    assert len(per) == 4 and maxin <= 6, (per, maxin)


def test_session_is_a_bonus_that_yields_when_the_replica_is_down(cluster):
    reps = [cluster.replica(kv=False) for _ in range(3)]
    rt = cluster.router(reps, "--strategy", "session", "--health-interval", "0.3")
    hdr = {"X-Session-Id": "alice"}
    home = complete(rt, "round 1", headers=hdr).headers["x-kvtier-replica"]
    for i in range(2, 6):  # different prompts, same session: stays home
        r = complete(rt, f"totally different text {i}", headers=hdr)
        assert r.headers["x-kvtier-replica"] == home
    victim = next(p for p in reps if p.url == home)
    victim.post("/admin/fault", json={"mode": "down"})
    wait_until(lambda: not {x["url"]: x["up"] for x in rt.get("/health").json()["replicas"]}[home])
    r = complete(rt, "round 6", headers=hdr)
    assert r.status_code == 200 and r.headers["x-kvtier-replica"] != home
    # the session moved: it now sticks to its new replica
    new_home = r.headers["x-kvtier-replica"]
    assert complete(rt, "round 7", headers=hdr).headers["x-kvtier-replica"] == new_home
    # body "user" works as the session key too
    r1 = rt.post("/v1/completions", json={"model": "m", "prompt": "q", "user": "bob"}).headers["x-kvtier-replica"]
    for i in range(3):
        assert rt.post("/v1/completions", json={"model": "m", "prompt": f"z{i}", "user": "bob"}
                       ).headers["x-kvtier-replica"] == r1
