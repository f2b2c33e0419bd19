"""Router tokenization: a local tokenizer, a replica's /tokenize (no local one), and the bytes fallback.

Real processes: test replicas tokenizing with a tiny BPE tokenizer (vLLM's /tokenize wire shape) and real
router processes. Routing tokens are observed through the router's predicted cached tokens, which equal the
replica's reported cached tokens only when both count the same token ids (bytes would count ~4x more).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from rotation import of_the_day
from router_helpers import complete, metric

DOC = "The quarterly report covers revenue, costs and the outlook for the next two quarters in detail. " * 6
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.devstack.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_tokenizer(out, 1000, 0)
    return out


def _stats(rep) -> dict:
    return httpx.get(rep.url + "/admin/stats", timeout=10).json()


def _shared_prefix_pair(rt) -> tuple[httpx.Response, httpx.Response]:
    first = complete(rt, DOC + "Question: what were the costs?")
    second = complete(rt, DOC + "Question: what is the outlook?")
    assert first.status_code == 200 and second.status_code == 200
    return first, second


def test_local_tokenizer_matches_replica_tokenize(cluster, tok_dir: Path):
    from router.tokens import Tokenizer

    rep = cluster.replica("--tokenizer", str(tok_dir), kv=False)
    local = Tokenizer(str(tok_dir))
    try:
        for kind, body in (("completion", {"model": "test-model", "prompt": DOC}),
                           ("chat", {"model": "test-model", "messages": MESSAGES})):
            r = httpx.post(rep.url + "/tokenize", json=body, timeout=10)
            assert r.status_code == 200
            want = local.encode(kind, body)
            assert r.json()["tokens"] == want
            assert len(want) < len(str(body.get("prompt") or body["messages"]).encode())  # real BPE, not bytes
    finally:
        local.close()
    asked = _stats(rep)["tokenize"]
    rt = cluster.router([rep], "--strategy", "prefixaware", "--tokenizer", str(tok_dir))
    _, second = _shared_prefix_pair(rt)
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert metric(rt, "kvtier_router_predicted_cached_tokens_total") == cached
    assert _stats(rep)["tokenize"] == asked  # a local tokenizer never asks the replica


@pytest.mark.parametrize("flag", of_the_day([[], ["--tokenizer", "/nonexistent/tokenizer-dir"], ["--tokenizer", "replica"]],
                                             ids=["flag0", "flag1", "flag2"]))
def test_without_local_tokenizer_router_uses_replica_tokenize(cluster, tok_dir: Path, flag: list[str]):
    reps = [cluster.replica("--tokenizer", str(tok_dir), kv=False) for _ in range(2)]
    rt = cluster.router(reps, "--strategy", "prefixaware", *flag)
    first, second = _shared_prefix_pair(rt)
    assert second.headers["x-kvtier-replica"] == first.headers["x-kvtier-replica"]
    assert second.headers["x-kvtier-route"] == "cache_hit"
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    # the router scored the replica's own token ids: its prediction is exactly what the engine reports
    assert metric(rt, "kvtier_router_predicted_cached_tokens_total") == cached
    asked = sum(_stats(r)["tokenize"] for r in reps)
    assert asked == 2
    assert complete(rt, DOC + "Question: what were the costs?").status_code == 200
    assert sum(_stats(r)["tokenize"] for r in reps) == asked  # the same prompt again: from the router's cache
    chat = rt.post("/v1/chat/completions", json={"model": "test-model", "messages": MESSAGES, "max_tokens": 2})
    assert chat.status_code == 200
    assert sum(_stats(r)["tokenize"] for r in reps) == asked + 1
    assert metric(rt, "kvtier_router_tokenize_fallback_total") == 0


def test_failing_replica_tokenize_falls_back_to_bytes_and_counts(cluster):
    rep = cluster.replica("--fault", "tokenize", kv=False)
    rt = cluster.router([rep], "--strategy", "prefixaware")
    for i in range(2):
        r = complete(rt, DOC + f"Question {i}?")
        assert r.status_code == 200, r.text
    assert _stats(rep)["tokenize"] == 2  # it was asked (and failed), and the failure was not cached
    assert metric(rt, "kvtier_router_tokenize_fallback_total") == 2
    # routed by bytes: the second prompt's shared prefix is predicted in bytes (the replica's own are bytes too)
    assert metric(rt, "kvtier_router_predicted_cached_tokens_total") > 0


@pytest.mark.unit
def test_small_bodies_encode_on_the_loop_large_ones_in_the_pool(tok_dir: Path):
    """A short prompt skips the pool's two thread hand-offs (they cost more than its encode on a box the engines
    keep busy); a long one still goes to the pool so it never stalls the event loop. The ids are the same."""
    import asyncio
    import json
    import threading

    from router.tokens import Tokenizer

    tok = Tokenizer(str(tok_dir), inline_bytes=4096)
    threads: list[str] = []
    real = tok._encode_text

    def spy(text: str, chat: bool) -> list[int]:
        threads.append(threading.current_thread().name)
        return real(text, chat)

    tok._encode_text = spy  # type: ignore[method-assign]
    short = {"model": "m", "messages": [{"role": "user", "content": DOC}]}
    long = {"model": "m", "messages": [{"role": "user", "content": DOC * 20}]}

    async def go() -> tuple[list[int], list[int], str]:
        a = await tok.aencode("chat", short, len(json.dumps(short)))
        b = await tok.aencode("chat", long, len(json.dumps(long)))
        return a, b, threading.current_thread().name

    try:
        a, b, loop_thread = asyncio.run(go())
        assert threads == [loop_thread, threads[1]] and threads[1].startswith("kvtier-tok"), threads
        fresh = Tokenizer(str(tok_dir))
        assert a == fresh.encode("chat", short) and b == fresh.encode("chat", long)
        fresh.close()
        assert asyncio.run(tok.aencode("chat", short, None)) == a  # size unknown: the cache, else the pool
    finally:
        tok.close()
