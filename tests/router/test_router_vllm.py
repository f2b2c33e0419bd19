"""Two real vLLM CPU replicas behind the router: a repeated prefix goes to the replica that holds it and hits.

Run with: flock /tmp/kvtier-vllm.lock .venv/bin/pytest tests/router/test_router_vllm.py -m vllm
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from router_helpers import Cluster, Proc, free_port, metric, wait_until

pytestmark = pytest.mark.vllm

replica_mod = pytest.importorskip("kvtier.devstack.replica")


@pytest.fixture(scope="module")
def vllm_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    tmp = tmp_path_factory.mktemp("router-vllm")

    def start(i: int):
        port, ev, rp = free_port(), free_port(), free_port()
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",  # vLLM binds only wildcard endpoints
               "replay_endpoint": f"tcp://127.0.0.1:{rp}", "topic": f"kv@r{i}@tiny"}
        rep = replica_mod.start_replica(
            tiny_model, port, lmcache=False, prefix_caching=True, kv_cache_gb=1, max_model_len=4096,
            served_model_name="tiny", log_path=tmp / f"vllm{i}.log", progress=False,
            extra_args=["--kv-events-config", json.dumps(cfg), "--enable-prompt-tokens-details",
                        "--max-num-seqs", "8"])
        rep.kv, rep.replay = f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}"
        return rep

    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(start, i) for i in range(2)]
        reps = []
        try:
            for f in futs:
                reps.append(f.result())
        except Exception:
            for f in futs:
                if f.done() and f.exception() is None:
                    f.result().stop()
            raise
    try:
        yield reps
    finally:
        for r in reps:
            r.stop()


def _complete(rt: Proc, prompt: str) -> httpx.Response:
    r = rt.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_repeated_prefix_goes_to_the_holder_and_hits(vllm_pair, tiny_model, tmp_path):
    a, b = vllm_pair
    c = Cluster(tmp_path)
    try:
        shim = [Proc(a.proc, a.url, a.log_path, a.kv, a.replay), Proc(b.proc, b.url, b.log_path, b.kv, b.replay)]
        rt = c.router(shim, "--strategy", "kvaware", "--tokenizer", str(tiny_model), kv=True)
        doc = " ".join(f"Cache token model prefix node number {i} of the shared document." for i in range(60))
        # warm replica b directly, bypassing the router: only b's own KV events can tell the router
        direct = httpx.post(b.url + "/v1/completions", timeout=300,
                            json={"model": "tiny", "prompt": doc + " Question one?", "max_tokens": 1})
        assert direct.status_code == 200
        wait_until(lambda: metric(rt, "kvtier_router_kv_events_total", replica=b.url, type="BlockStored") > 0,
                 timeout=30)
        hits = []
        for q in ("two", "three", "four"):
            r = _complete(rt, doc + f" Question {q}?")
            assert r.headers["x-kvtier-replica"] == b.url, r.headers
            assert r.headers["x-kvtier-route"] == "cache_hit"
            hits.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
        # the engine itself reports the shared document as cached (all but the last partial block)
        assert min(hits) >= prompt_tokens // 2, (hits, prompt_tokens)
        # a different document goes by load/cost, and then sticks to wherever it went
        other = " ".join(f"Another unrelated text about the number {i} and the token model." for i in range(60))
        first = _complete(rt, other + " A?").headers["x-kvtier-replica"]
        r = _complete(rt, other + " B?")
        assert r.headers["x-kvtier-replica"] == first
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert metric(rt, "kvtier_router_actual_cached_tokens_total") > 0
    finally:
        c.close()
