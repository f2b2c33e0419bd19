"""The workload bench reads kvtier's router's own time and L2 lookups from the router's real /metrics text."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvtier.bench.cross_pod import parse_counters
from kvtier.bench.workload import ROUTER_SERIES, router_ms
from router.metrics import Metrics

pytestmark = pytest.mark.unit


def _read(m: Metrics) -> dict[str, float]:
    got = parse_counters(generate_latest(m.registry).decode(), tuple(ROUTER_SERIES.values()))
    return {k: got[name] for k, name in ROUTER_SERIES.items() if name in got}


def test_router_time_and_l2_lookups_per_step_from_the_exposition() -> None:
    m = Metrics()
    m.overhead.observe(0.001)
    before = _read(m)
    assert "l2_skipped" not in before  # no lookup result yet: the labelled series are not exposed
    for result, k in (("hit", 2), ("miss", 1), ("skipped", 5)):
        for _ in range(k):
            m.l2_lookups.labels(result).inc()
    m.overhead.observe(0.003)
    m.overhead.observe(0.005)
    out = router_ms(before, _read(m))
    assert out["router_overhead_ms"] == pytest.approx(4.0)
    assert (out["router_l2_hit"], out["router_l2_miss"], out["router_l2_failed"], out["router_l2_skipped"]) == (2, 1, 0, 5)
    assert "router_l2_skipped" not in router_ms({}, {"overhead_sum": 0.1, "overhead_count": 1.0})  # no L2 lookups: no keys


def test_a_labelled_name_selects_one_series_and_a_bare_name_sums_them() -> None:
    text = 'x_total{result="hit"} 2.0\nx_total{result="skipped"} 5.0\n# HELP y\ny 1.5\n'
    assert parse_counters(text, ('x_total{result="skipped"}', "x_total", "y")) == {
        'x_total{result="skipped"}': 5.0, "x_total": 7.0, "y": 1.5}
