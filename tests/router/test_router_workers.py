"""`kvtier router --workers N` (N router processes on one SO_REUSEPORT port) and the admission gate that answers
before the request body is read. Real router processes in front of real test replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from router_helpers import metric, wait_until

from router.app import merge_metrics

PROMPT = "workers share one port, shared system prompt long enough for several blocks " * 2


def _post(url: str, prompt: str) -> httpx.Response:
    """One request on a new connection (SO_REUSEPORT spreads connections, not requests)."""
    return httpx.post(url + "/v1/completions", json={"model": "test-model", "prompt": prompt, "max_tokens": 2},
                      timeout=30)


def test_two_workers_serve_one_port_and_agree_on_prefixes(cluster):
    reps = [cluster.replica(kv=False) for _ in range(4)]
    rt = cluster.router(reps, "--strategy", "prefixaware", "--prefix-affinity", "--workers", "2")
    pids: dict[str, set[str]] = {}  # worker pid -> replicas it sent something to
    homes = set()
    for doc in range(8):
        prefix = f"doc {doc} {PROMPT}"
        first = _post(rt.url, prefix + "the first question")
        assert first.status_code == 200
        home = first.headers["x-kvtier-replica"]
        homes.add(home)
        for q in range(4):  # whichever worker answers, the prefix stays on its replica and is served cached
            r = _post(rt.url, prefix + f"follow-up question {q}")
            assert r.status_code == 200
            assert r.headers["x-kvtier-replica"] == home, (doc, q, r.headers["x-kvtier-router-pid"])
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix) - 16
            pids.setdefault(r.headers["x-kvtier-router-pid"], set()).add(home)
    # 32 connections spread by the kernel's hash: all on one worker would happen 1 in 2^31
    assert len(pids) == 2, pids
    assert str(rt.p.pid) not in pids  # the supervisor itself serves nothing
    assert len(homes) > 1
    # /metrics on the shared port merges both workers, whichever answers the scrape
    for _ in range(4):
        text = httpx.get(rt.url + "/metrics", headers={"connection": "close"}, timeout=10).text
        assert "kvtier_router_workers_scraped 2.0" in text
        assert 'worker="0"' in text and 'worker="1"' in text
    assert metric(rt, "kvtier_router_requests_total", code="200") == 8 * 5


def test_a_dead_worker_is_replaced_and_the_port_keeps_serving(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep], "--strategy", "roundrobin", "--workers", "2")
    seen = {_post(rt.url, f"{i} {PROMPT}").headers["x-kvtier-router-pid"] for i in range(16)}
    assert len(seen) == 2
    victim = int(sorted(seen)[0])
    os.kill(victim, signal.SIGKILL)
    # every request is answered meanwhile (the kernel only hands connections to listening workers)
    new = wait_until(lambda: {_post(rt.url, f"again {i}").headers["x-kvtier-router-pid"] for i in range(8)}
                   - seen, timeout=30)
    assert str(victim) not in new
    assert rt.p.poll() is None


def _flood(url: str, n: int) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            return await asyncio.gather(*(c.post(url + "/v1/completions", json={
                "model": "test-model", "prompt": f"{i} {PROMPT}", "max_tokens": 2}) for i in range(n)))

    return asyncio.run(run())


def test_burst_on_two_workers_is_answered_or_rejected_never_lost(cluster):
    rep = cluster.replica("--decode-ms-per-token", "1000", kv=False)
    rt = cluster.router([rep], "--strategy", "prefixaware", "--workers", "2", "--max-inflight", "2",
                        "--max-queue", "1", "--queue-timeout", "30", "--retry-after", "2")
    out = _flood(rt.url, 30)
    codes = [r.status_code for r in out]
    ok, rejected = codes.count(200), [r for r in out if r.status_code == 429]
    assert ok + len(rejected) == 30, codes
    assert 3 <= ok <= 6, codes  # per worker 2 in flight + 1 queued (at least one worker got some)
    assert all(r.headers["retry-after"] == "2" for r in rejected)
    assert rep.get("/admin/stats").json()["requests"] == ok  # rejected ones never reached the replica
    assert metric(rt, "kvtier_router_rejected_total", reason="queue_full") == len(rejected)  # summed over workers


def test_a_full_router_answers_429_before_the_body_arrives(cluster):
    rep = cluster.replica("--decode-ms-per-token", "400", kv=False)
    rt = cluster.router([rep], "--max-inflight", "1", "--max-queue", "0")
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 20, "stream": True}
    with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=30) as s:
        assert s.status_code == 200  # holds the only slot while it streams (~8 s)
        u = urlsplit(rt.url)
        with socket.create_connection((u.hostname, u.port), timeout=10) as c:
            # headers and the start of a 100 kB body that never comes: only a gate in front of the body read
            # can answer this
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n{\"model\": \"test-model\", \"prompt\": \"")
            head = c.recv(65536).decode()
        assert head.startswith("HTTP/1.1 429"), head
        assert "retry-after: 1" in head.lower()
        for _ in s.iter_raw():
            pass
    assert metric(rt, "kvtier_router_rejected_total", reason="queue_full") == 1
    assert _post(rt.url, PROMPT).status_code == 200  # the slot is free again


@pytest.mark.unit
def test_merged_metrics_label_each_worker_and_keep_one_family():
    a = (b"# HELP kvtier_router_x_total x\n# TYPE kvtier_router_x_total counter\n"
         b'kvtier_router_x_total{reason="a"} 2.0\n# HELP kvtier_router_g g\n# TYPE kvtier_router_g gauge\n'
         b"kvtier_router_g 1.0\n")
    b = a.replace(b"2.0", b"5.0").replace(b"g 1.0", b"g 3.0")
    text = merge_metrics({0: a, 1: b, 2: None}).decode()
    assert text.count("# TYPE kvtier_router_x_total counter") == 1
    assert 'kvtier_router_x_total{reason="a",worker="0"} 2.0' in text
    assert 'kvtier_router_x_total{reason="a",worker="1"} 5.0' in text
    assert 'kvtier_router_g{worker="1"} 3.0' in text
    assert "kvtier_router_workers_scraped 2.0" in text  # worker 2 did not answer this scrape
