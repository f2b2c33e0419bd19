"""Predicted vs engine-reported cached tokens: precision and recall move as they should (real processes)."""

from __future__ import annotations

import httpx
import pytest
from router_helpers import complete, metric

from router.accounting import CacheAccounting


def _gauge(rt, name: str, tier: str = "all") -> float:
    return metric(rt, f"kvtier_router_cache_{name}", tier=tier)


def _stream(rt, prompt: str) -> int:
    """A streaming request; returns the engine's cached tokens from its usage chunk (read by the router too)."""
    body = {"model": "test-model", "prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if '"usage"' in ln]
    return int(httpx.Response(200, content=lines[-1][5:]).json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_precision_and_recall_follow_hits_over_advertised_and_unseen_prompts(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep], "--strategy", "prefixaware")
    prompt = "a prompt of exactly one hundred bytes, routed twice through the router to measure its prediction."
    prompt += "." * (100 - len(prompt))

    def cached(r: httpx.Response) -> int:
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(complete(rt, prompt)) == 0  # new: nothing predicted, nothing cached
    assert (_gauge(rt, "precision"), _gauge(rt, "recall")) == (1.0, 1.0)
    # a hit: 6 whole blocks predicted (the 100th token is always recomputed) and 6 served
    assert cached(complete(rt, prompt)) == 96
    assert _gauge(rt, "predicted_tokens_total", "L0") == _gauge(rt, "matched_tokens_total") == 96
    assert (_gauge(rt, "precision"), _gauge(rt, "recall")) == (1.0, 1.0)
    # over-advertised: the engine lost its cache behind the router's back, the router still predicts 96
    assert rep.post("/reset_prefix_cache").status_code == 200
    assert cached(complete(rt, prompt)) == 0
    assert _gauge(rt, "predicted_tokens_total") == 192 and _gauge(rt, "matched_tokens_total") == 96
    assert (_gauge(rt, "precision"), _gauge(rt, "precision", "L0"), _gauge(rt, "recall")) == (0.5, 0.5, 1.0)
    # under-predicted: the engine has a prompt the router never routed: recall drops, precision stays
    other = prompt.replace("a prompt", "b prompt")
    assert rep.post("/v1/completions", json={"model": "test-model", "prompt": other, "max_tokens": 1}).status_code == 200
    assert cached(complete(rt, other)) == 96
    assert (_gauge(rt, "precision"), _gauge(rt, "recall")) == (0.5, 0.5)
    assert _gauge(rt, "predicted_tokens_total", "L2") == 0  # no --l2fs-master: no L2 prediction
    # streams count too (the usage chunk at the end of the SSE stream)
    third = prompt.replace("a prompt", "c prompt")
    assert _stream(rt, third) == 0 and _stream(rt, third) == 96
    assert _gauge(rt, "actual_tokens_total") == 288
    assert _gauge(rt, "precision") == pytest.approx(192 / 288) and _gauge(rt, "recall") == pytest.approx(192 / 288)


@pytest.mark.unit
def test_tier_split_credits_the_engine_cache_first_and_caps_like_vllm():
    from prometheus_client import CollectorRegistry

    a = CacheAccounting(CollectorRegistry())
    # L0 predicts 32, L2 holds 512 of a 1000-token prompt; the engine reports 300 (L2 short by 212)
    assert a.record(32, 512, 300, 1000, 16) == (32, 480, 512)
    assert (a.matched["L0"], a.matched["L2"], a.matched["all"]) == (32, 268, 300)
    assert a.precision("L0") == 1.0 and a.precision("L2") == pytest.approx(268 / 480)
    # an L2 hit covering the whole prompt: at most the whole blocks before the last token
    assert a.record(0, 256, 240, 256, 16) == (0, 240, 240)
    assert a.recall() == 1.0


@pytest.mark.unit
def test_tier_costs_are_configurable_and_checked():
    from router.app import Router, RouterConfig
    from router.cli import main, parse_tier_cost
    from router.index import MEDIUM_WEIGHT

    assert parse_tier_cost("l2=0.1, L1=0") == ({"L2": 0.1, "L1": 0.0}, False)
    assert parse_tier_cost("L2=auto") == ({"L2": 0.5}, True)
    assert parse_tier_cost("L2=auto:0.3") == ({"L2": 0.3}, True)
    for bad in ("L3=0.1", "L2", "L2=x", "L2=1.5", "L2=autox", "L1=auto"):
        with pytest.raises(ValueError):
            parse_tier_cost(bad)
    assert main(["--replicas", "http://a:1", "--tier-cost", "L2=2"]) == 2
    for flag in ("--request-cost", "--decode-beta", "--load-epsilon", "--l2fs-min-tokens", "--tokenize-inline-bytes"):
        assert main(["--replicas", "http://a:1", flag, "-1"]) == 2, flag
    with pytest.raises(ValueError, match="request-cost"):
        Router(RouterConfig(replicas=["http://a:1"], request_cost=-1.0))
    assert Router(RouterConfig(replicas=["http://a:1"], request_cost=64.0)).policy.request_cost == 64.0
    before = dict(MEDIUM_WEIGHT)
    rt = Router(RouterConfig(replicas=["http://a:1"], tier_cost={"L2": 0.25, "L1": 0.5}))
    assert rt.policy.l2_credit == 0.75 and rt.policy.kv.medium_weight["CPU"] == 0.5
    assert 'kvtier_router_tier_cost{tier="L2"} 0.25' in rt.metrics().body.decode()
    assert MEDIUM_WEIGHT == before  # the router's own index: no process-wide table changed under other routers


@pytest.mark.unit
def test_calibrator_recovers_the_relative_cost_of_loaded_tokens():
    import random

    from router.accounting import TierCostCalibrator

    rng, cal = random.Random(7), TierCostCalibrator(min_samples=64)
    for i in range(200):  # prefill: 100 us per computed token, 25 us per loaded one, plus queueing noise
        x1, x2 = rng.randint(0, 2000), rng.randint(0, 2000)
        cal.add(0.02 + 1e-4 * x1 + 2.5e-5 * x2 + rng.uniform(0, 0.01), x1, x2)
        if i < 63:
            assert cal.l2_cost() is None  # too few samples
    assert cal.l2_cost() == pytest.approx(0.25, abs=0.03)
    flat = TierCostCalibrator(min_samples=4)
    for _ in range(10):
        flat.add(0.1, 100, 0)  # nothing ever loaded: no estimate, not a made-up one
    assert flat.l2_cost() is None


@pytest.mark.unit
def test_auto_l2_cost_replaces_the_start_value_once_fitted():
    import random

    from router.app import Router, RouterConfig

    rt = Router(RouterConfig(replicas=["http://a:1"], tier_cost={"L2": 0.5}, calibrate_l2=True))
    assert rt.policy.l2_credit == 0.5
    rng = random.Random(3)
    for _ in range(128):  # loaded tokens cost 10 % of computed ones
        x1, x2 = rng.randint(0, 1000), rng.randint(0, 1000)
        rt._calibrate(0.01 + 1e-4 * x1 + 1e-5 * x2, x1, x2)
    assert rt.policy.l2_credit == pytest.approx(0.9, abs=1e-6)
    line = next(ln for ln in rt.metrics().body.decode().splitlines() if ln.startswith('kvtier_router_tier_cost{tier="L2"}'))
    assert float(line.split()[-1]) == pytest.approx(0.1)
