"""Admission control against real processes: a router in front of slow test replicas, flooded past its bounds."""

from __future__ import annotations

import asyncio
import time

import httpx
from router_helpers import metric, wait_until

BODY = {"model": "test-model", "prompt": "admission control " * 8, "max_tokens": 2}


def _flood(url: str, n: int) -> list[httpx.Response]:
    """n requests at once from one event loop, each on its own connection, so they reach the router together."""
    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            return await asyncio.gather(*(c.post(url + "/v1/completions",
                                                  json={**BODY, "prompt": f"{i} {BODY['prompt']}"})
                                          for i in range(n)))

    return asyncio.run(run())


def test_flood_beyond_bounds_gets_429_and_admitted_complete(cluster):
    # 3 s per request on the replica, so the flood overlaps; the queue timeout is long enough for the queued
    # requests to get a slot once the first four are done
    rep = cluster.replica("--decode-ms-per-token", "1500", kv=False)
    rt = cluster.router([rep], "--strategy", "prefixaware", "--max-inflight", "4", "--max-queue", "4",
                        "--queue-timeout", "30", "--retry-after", "3")
    out = _flood(rt.url, 24)
    ok = [r for r in out if r.status_code == 200]
    rejected = [r for r in out if r.status_code == 429]
    assert len(ok) + len(rejected) == 24, [r.status_code for r in out]
    # 4 in flight + 4 queued, all completed (more only if a slot came free before the flood was in)
    assert 8 <= len(ok) <= 12 and len(rejected) >= 12
    for r in rejected:
        assert r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
    # rejected requests cost no upstream call (and no tokenization: only admitted ones were tokenized)
    stats = rep.get("/admin/stats").json()
    assert stats["requests"] == len(ok) and stats["max_inflight"] == 4
    assert metric(rt, "kvtier_router_rejected_total", reason="queue_full") == len(rejected)
    assert metric(rt, "kvtier_router_tokenize_seconds_count") == len(ok)
    assert metric(rt, "kvtier_router_queue_depth_max") == 4  # filled to its bound, never beyond
    assert metric(rt, "kvtier_router_queue_depth") == 0
    assert metric(rt, "kvtier_router_admitted") == 0  # every slot released
    # once the flood is over, the router takes traffic again
    assert _flood(rt.url, 2)[0].status_code == 200


def test_per_replica_bound_and_queue_timeout(cluster):
    reps = [cluster.replica("--decode-ms-per-token", "2500", kv=False) for _ in range(2)]
    rt = cluster.router(reps, "--strategy", "roundrobin", "--max-inflight", "0", "--max-inflight-per-replica", "2",
                        "--max-queue", "3", "--queue-timeout", "0.2")
    out = _flood(rt.url, 10)
    codes = sorted(r.status_code for r in out)
    assert codes == [200] * 4 + [429] * 6, codes  # 2 replicas x 2 slots
    for rep in reps:
        assert rep.get("/admin/stats").json()["max_inflight"] <= 2
    assert metric(rt, "kvtier_router_rejected_total", reason="queue_full") == 3
    assert metric(rt, "kvtier_router_rejected_total", reason="queue_timeout") == 3  # the 3 queued never got a slot
    assert metric(rt, "kvtier_router_queue_depth_max") == 3


def test_no_healthy_replica_is_a_fast_503_with_retry_after(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep])
    rep.stop()
    wait_until(lambda: rt.get("/health").status_code == 503)
    r = rt.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert metric(rt, "kvtier_router_rejected_total", reason="no_replica") >= 1


def test_streams_hold_their_slot_until_sent_and_give_it_back(cluster):
    rep = cluster.replica("--decode-ms-per-token", "300", kv=False)
    rt = cluster.router([rep], "--max-inflight", "1", "--max-queue", "0")
    body = {**BODY, "stream": True, "max_tokens": 4}
    with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=30) as s:
        assert s.status_code == 200
        chunks = s.iter_raw()  # keep the iterator: dropping it closes the response (the client leaves)
        next(chunks)  # the first chunk is in: the stream is still being sent
        busy = httpx.post(rt.url + "/v1/completions", json=BODY, timeout=30)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"  # the one slot is the stream's
        # the client leaves mid-stream: the slot must come back anyway
    wait_until(lambda: metric(rt, "kvtier_router_admitted") == 0)
    assert httpx.post(rt.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
    with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=30) as s:
        assert b"[DONE]" in b"".join(s.iter_raw())  # read to the end
    wait_until(lambda: metric(rt, "kvtier_router_admitted") == 0)
    assert metric(rt, "kvtier_router_rejected_total", reason="queue_full") == 1


def test_a_wait_longer_than_the_queue_timeout_is_rejected_at_once(cluster):
    # each request holds its slot ~3 s (2 tokens x 1.5 s); 2 slots; the queue timeout is 5 s. Once the router has
    # seen slots held that long, queue places 1-3 are predicted a slot within 5 s (1.5, 3, 4.5 s) and wait,
    # places 4+ (6 s+) get their 429 at once instead of after the 5 s they would have waited for it
    rep = cluster.replica("--decode-ms-per-token", "1500", kv=False)
    rt = cluster.router([rep], "--max-inflight", "2", "--max-queue", "8", "--queue-timeout", "5")
    assert [r.status_code for r in _flood(rt.url, 2)] == [200, 200]  # the router learns the hold time

    async def timed(c: httpx.AsyncClient, i: int) -> tuple[int, float]:
        t0 = time.monotonic()
        r = await c.post(rt.url + "/v1/completions", json={**BODY, "prompt": f"w{i} {BODY['prompt']}"})
        return r.status_code, time.monotonic() - t0

    async def run() -> list[tuple[int, float]]:
        limits = httpx.Limits(max_connections=10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            return await asyncio.gather(*(timed(c, i) for i in range(10)))

    out = asyncio.run(run())
    assert all(code in (200, 429) for code, _ in out), out
    fast = [dt for code, dt in out if code == 429 and dt < 2.5]  # answered before the first upstream answer (3 s)
    assert len(fast) >= 5, out
    assert metric(rt, "kvtier_router_rejected_total", reason="queue_wait") == len(fast)
    assert rep.get("/admin/stats").json()["requests"] == 2 + sum(code == 200 for code, _ in out)
    assert metric(rt, "kvtier_router_admitted") == 0
