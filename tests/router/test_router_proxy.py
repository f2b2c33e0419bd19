"""Proxy behaviour of the router against real test-replica processes: errors, retries, ejection, cancel."""

from __future__ import annotations

import json
import threading
import time

import httpx
from router_helpers import complete, metric, wait_until


def test_bad_input_gets_clear_errors(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep], "--max-body-bytes", "100000", "--api-key", "sekret")
    auth = {"Authorization": "Bearer sekret"}
    r = rt.post("/v1/completions", content=b'{"model": "m", "prompt": "x"}')
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = rt.post("/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = rt.post("/v1/completions", content=b"[1, 2]", headers=auth)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = rt.post("/v1/completions", json={"prompt": "x"}, headers=auth)
    assert r.status_code == 400 and "'model'" in r.json()["error"]["message"]
    r = rt.post("/v1/completions", json={"model": "m", "prompt": "x" * 200_000}, headers=auth)
    assert r.status_code == 413
    r = rt.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers={**auth, "X-Kvtier-Strategy": "magic"})
    assert r.status_code == 400 and "unknown strategy 'magic'" in r.json()["error"]["message"]
    r = rt.post("/v1/chat/completions", json={"model": "m", "messages": "hello"}, headers=auth)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = rt.post("/v1/completions", json={"model": "m", "prompt": 42}, headers=auth)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    # token-id prompts with nulls, strings, floats, bools or negatives (fuzzing found [[null]] -> 500)
    for bad in ([[None]], [1, "a"], [[1, 2.5]], [1, True], [[-1]], [3, [4]]):
        r = rt.post("/v1/completions", json={"model": "m", "prompt": bad},
                    headers={**auth, "X-Kvtier-Strategy": "prefixaware"})
        assert r.status_code == 400 and "non-negative integers" in r.json()["error"]["message"], (bad, r.text)
    # a replica's 400 passes through as a 400 (the test replica once crashed on these: fuzzing saw a 500)
    for bad in ([None], "2", 0, 1.5):
        r = rt.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": bad}, headers=auth)
        assert r.status_code == 400 and "max_tokens" in r.text, (bad, r.text)
    # the router is still up and serves a good request; the client's key is not forwarded upstream
    r = complete(rt, "hello", headers=auth)
    assert r.status_code == 200, r.text
    assert rt.get("/health").status_code == 200
    assert metric(rt, "kvtier_router_rejected_total", reason="bad_json") == 2


def test_request_id_kept_or_added(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep])
    r = complete(rt, "abc", headers={"X-Request-Id": "my-id-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-123"
    r2 = complete(rt, "abc")
    gen = r2.headers["x-request-id"]
    assert gen and gen != "my-id-123"
    seen = rep.get("/admin/stats").json()["request_ids"]
    assert seen[-2:] == ["my-id-123", gen]


def test_models_health_metrics(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep])
    assert rt.get("/v1/models").json()["data"][0]["id"] == "test-model"
    h = rt.get("/health").json()
    assert h["status"] == "ok" and h["replicas"][0]["url"] == rep.url
    complete(rt, "x")
    assert metric(rt, "kvtier_router_requests_total", code="200") == 1
    assert metric(rt, "kvtier_router_overhead_seconds_count") == 1
    # the process froze its start-up heap once serving, and its collections are measured (router.gcpause)
    assert metric(rt, "kvtier_router_gc_frozen_objects") > 10_000
    assert metric(rt, "kvtier_router_gc_pause_seconds_count", generation="2") >= 1
    from kvtier.bench.routing_sim import gc_pauses  # what `kvtier bench routing-sim` reads of it

    seconds, full, over_10ms = gc_pauses(rt.url) or (0.0, 0.0, -1.0)
    assert seconds > 0 and full >= 1 and over_10ms >= 0
    assert gc_pauses(rep.url) is None  # a server without the metric (the test replica, vllm-router): no figure


def test_retry_on_5xx_and_429_then_eject(cluster):
    bad = cluster.replica("--fault", "500", kv=False)
    busy = cluster.replica("--fault", "429", kv=False)
    good = cluster.replica(kv=False)
    rt = cluster.router([bad, busy, good], "--strategy", "roundrobin", "--health-interval", "30")
    for i in range(6):
        r = complete(rt, f"p{i}")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvtier-replica"] == good.url
    assert good.get("/admin/stats").json()["completed"] == 6
    # the 500 replica was ejected after its first failure (passive), the 429 one was only skipped
    assert metric(rt, "kvtier_router_retries_total", reason="500") == 1
    assert metric(rt, "kvtier_router_retries_total", reason="429") >= 1


def test_all_replicas_failing_returns_upstream_error(cluster):
    bad = cluster.replica("--fault", "429", kv=False)
    rt = cluster.router([bad])
    r = complete(rt, "x")
    assert r.status_code == 429
    assert rt.get("/health").status_code == 200


def test_dead_replica_gets_no_traffic_after_one_health_interval(cluster):
    a = cluster.replica(kv=False)
    b = cluster.replica(kv=False)
    rt = cluster.router([a, b], "--strategy", "roundrobin", "--health-interval", "0.5")
    a.stop()
    time.sleep(0.6)  # one health interval
    before = metric(rt, "kvtier_router_retries_total")
    for i in range(10):
        r = complete(rt, f"q{i}")
        assert r.status_code == 200 and r.headers["x-kvtier-replica"] == b.url
    assert metric(rt, "kvtier_router_retries_total") == before  # not even tried
    assert {x["url"]: x["up"] for x in rt.get("/health").json()["replicas"]} == {a.url: False, b.url: True}


def test_dead_replica_connect_error_retries_immediately(cluster):
    a = cluster.replica(kv=False)
    b = cluster.replica(kv=False)
    rt = cluster.router([a, b], "--strategy", "roundrobin", "--health-interval", "60")
    a.stop()
    for i in range(4):
        r = complete(rt, f"q{i}")
        assert r.status_code == 200 and r.headers["x-kvtier-replica"] == b.url
    assert metric(rt, "kvtier_router_retries_total", reason="connect") == 1


def test_garbage_and_hanging_replicas(cluster):
    garbage = cluster.replica("--fault", "garbage", kv=False)
    rt = cluster.router([garbage])
    r = complete(rt, "x")
    assert r.status_code == 502 and "invalid response" in r.json()["error"]["message"]
    hang = cluster.replica("--fault", "hang", kv=False)
    rt2 = cluster.router([hang], "--upstream-timeout", "1.5")
    t0 = time.monotonic()
    r = complete(rt2, "x")
    assert r.status_code == 504 and "did not answer" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert rt2.get("/health").status_code in (200, 503)  # router itself still answers
    # a stream request answered with a non-SSE body is a 502 too
    rep = cluster.replica("--fault", "garbage", kv=False)
    rt3 = cluster.router([rep])
    r = complete(rt3, "x", stream=True)
    assert r.status_code in (200, 502)
    if r.status_code == 502:
        assert "stream" in r.json()["error"]["message"]


def test_streaming_is_passed_through_unbuffered(cluster):
    rep = cluster.replica("--decode-ms-per-token", "200", kv=False)
    rt = cluster.router([rep])
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
    t0 = time.monotonic()
    first = None
    chunks = []
    with httpx.stream("POST", rt.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                if first is None:
                    first = time.monotonic() - t0
                chunks.append(line[6:])
    total = time.monotonic() - t0
    assert chunks[-1] == "[DONE]"
    usage = json.loads(chunks[-2])["usage"]
    assert usage["completion_tokens"] == 10
    # 10 tokens x 200 ms: the first token reaches the client long before the stream ends
    assert total > 1.8 and first < total / 2


def _abort_after(url: str, body: dict, seconds: float) -> None:
    def go() -> None:
        t0 = time.monotonic()
        try:
            with httpx.stream("POST", url, json=body, timeout=seconds) as r:
                for _ in r.iter_bytes():
                    if time.monotonic() - t0 > seconds:
                        break  # closing the stream = the client going away
        except httpx.TimeoutException:
            pass

    t = threading.Thread(target=go)
    t.start()
    t.join()


def test_client_disconnect_cancels_upstream_nonstreaming_and_streaming(cluster):
    rep = cluster.replica("--decode-ms-per-token", "50", kv=False)
    rt = cluster.router([rep])
    body = {"model": "test-model", "prompt": "long one", "max_tokens": 200}  # 10 s if not cancelled
    _abort_after(rt.url + "/v1/completions", body, 0.7)
    wait_until(lambda: rep.get("/admin/stats").json()["cancelled"] == 1, timeout=5)
    _abort_after(rt.url + "/v1/completions", {**body, "stream": True}, 0.7)
    wait_until(lambda: rep.get("/admin/stats").json()["cancelled"] == 2, timeout=5)
    st = rep.get("/admin/stats").json()
    assert st["completed"] == 0 and st["inflight"] == 0
    # and the router's own in-flight accounting did not leak
    wait_until(lambda: rt.get("/health").json()["replicas"][0]["inflight"] == 0, timeout=5)
    assert metric(rt, "kvtier_router_client_disconnects_total") == 2


def test_router_time_header_excludes_the_replica(cluster):
    # the replica sleeps 4 x 60 ms decoding before it answers: that wait is upstream time, not the router's
    rep = cluster.replica("--decode-ms-per-token", "60", kv=False)
    rt = cluster.router([rep], "--strategy", "prefixaware")
    t0 = time.perf_counter()
    r = complete(rt, "a prompt the router tokenizes", max_tokens=4)
    e2e_ms = (time.perf_counter() - t0) * 1e3
    assert r.status_code == 200, r.text
    own, tok = float(r.headers["x-kvtier-router-ms"]), float(r.headers["x-kvtier-tokenize-ms"])
    assert own >= 0 and tok > 0
    assert own + tok <= e2e_ms - 200  # the replica's >= 240 ms of sleeping is in neither number
    # roundrobin does not tokenize; a streamed answer carries the header too
    r = complete(rt, "x", headers={"X-Kvtier-Strategy": "roundrobin"}, stream=True, max_tokens=1)
    assert r.status_code == 200 and "data: [DONE]" in r.text
    assert float(r.headers["x-kvtier-tokenize-ms"]) == 0 and float(r.headers["x-kvtier-router-ms"]) >= 0
