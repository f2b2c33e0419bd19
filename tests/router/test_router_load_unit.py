"""Unit tier: reading vLLM's load gauges and turning them into other routers' load."""

from __future__ import annotations

import pytest

from router.policy import Policy
from router.replicas import Replica, parse_load

pytestmark = pytest.mark.unit

PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
vllm:num_requests_swapped 7
"""


def test_parse_sums_engines_and_ignores_lookalikes():
    assert parse_load(PAGE) == (5.0, 4.0)
    assert parse_load("vllm:prefix_cache_hits_total 3\n") is None  # no gauge: unknown, not idle
    assert parse_load("vllm:num_requests_waiting nan-ish\n") is None


def test_own_requests_are_subtracted_and_waiting_counted_first():
    r = Replica("http://r", inflight=3)
    r.scraped(running=5, waiting=4, own=3)
    assert (r.ext_running, r.ext_waiting) == (2, 4)
    assert r.load == 9
    r.scraped(running=1, waiting=0, own=3)  # ours not arrived yet: never negative
    assert (r.ext_running, r.ext_waiting, r.load) == (0, 0, 3)


def test_external_load_enters_cost_and_load_cap():
    p = Policy()
    a, b = Replica("http://a"), Replica("http://b")
    b.scraped(running=0, waiting=8, own=0)
    for _ in range(20):
        assert p.choose("prefixaware", [a, b], list(range(64))).replica is a
    assert p.cost(b, 64, 0, 0) - p.cost(a, 64, 0, 0) == 8 * 64
