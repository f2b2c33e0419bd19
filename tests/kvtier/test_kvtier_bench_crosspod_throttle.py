"""`kvtier bench cross-pod --throttle-l2 / --prefill-tokens-per-s`: argument rules, the throttle spec, and the
summary arithmetic (ratio to min(cold, healthy L2 hit), declined claims). The runs themselves need engines
(docs/results.md section 7)."""

from __future__ import annotations

import pytest

from kvtier.bench.cross_pod import floor_fields, main
from kvtier.bench.cross_pod_throttle import goal_line, parse_throttle, summarize_throttled

pytestmark = pytest.mark.unit


def test_throttle_spec() -> None:
    s = parse_throttle("stop:2.7/0.3")
    assert (s.kind, s.on_s, s.off_s, str(s)) == ("stop", 2.7, 0.3, "stop:2.7/0.3")
    assert s.lead_s == pytest.approx(6.0)
    assert parse_throttle("rate:20mbit").rate == "20mbit"
    for bad in ("stop:3", "stop:0/1", "stop:a/b", "rate:fast", "pause:1/1", ""):
        with pytest.raises(ValueError):
            parse_throttle(bad)


@pytest.mark.parametrize("argv, message", [
    (["--throttle-l2", "stop:2.7/0.3", "--from-up", "up.json"], "need a stack started here"),
    (["--throttle-l2", "stop:1/1", "--replica-a", "http://a", "--replica-b", "http://b"], "need a stack started"),
    (["--throttle-l2", "rate:20mbit"], "needs --netns"),
    (["--throttle-l2", "stop:x"], "stop:ON/OFF"),
    (["--prefill-tokens-per-s", "fast"], "a number of tokens/s >= 0, or auto"),
    (["--prefill-tokens-per-s", "auto", "--mode", "mount"], "--mode plugin"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv: list[str], message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _rows(phase: str, l2: list[float], cold: list[float], hits: list[int]) -> list[dict]:
    out = []
    for rep, (t_l2, t_cold, hit) in enumerate(zip(l2, cold, hits, strict=True)):
        out.append({"phase": phase, "prompt_tokens": 2048, "rep": rep, "arm": "store A", "ttft_ms": 500.0})
        out.append({"phase": phase, "prompt_tokens": 2048, "rep": rep, "arm": "L2 arm B", "ttft_ms": t_l2,
                    "lmcache_hit_tokens": hit, "gated": hit == 0})
        out.append({"phase": phase, "prompt_tokens": 2048, "rep": rep, "arm": "cold arm B", "ttft_ms": t_cold,
                    "lmcache_hit_tokens": 0, "gated": False})
    return out


def test_summary_ratio_and_declined_claims() -> None:
    raw = (_rows("healthy", [100, 120, 110], [600, 650, 700], [2048, 2048, 2048])
           + _rows("throttled", [2800, 640, 660], [600, 620, 700], [2048, 0, 0]))
    rows, text = summarize_throttled(raw, [2048])
    healthy, throttled = rows
    assert healthy["gated"] == 0 and healthy["ratio_to_best"] == pytest.approx(110 / 110)
    # throttled: median L2 660 vs min(cold 620, healthy L2 110) = 110 -> 6x, two of three claims declined
    assert throttled["l2_arm_p50_ms"] == 660 and throttled["cold_arm_p50_ms"] == 620
    assert throttled["ratio_to_best"] == pytest.approx(660 / 110)
    assert throttled["gated"] == 2 and throttled["b_hit_tokens_min"] == 0
    # same phase: the one claimed (slow) hit took 2800 ms, so the best choice was recompute (620)
    assert throttled["claimed_l2_p50_ms"] == 2800
    assert throttled["ratio_same_phase"] == pytest.approx(660 / 620)
    assert "2/3" in text
    assert "-> worst 1.06x at 2048 (met)" in goal_line(rows)
    # every hit claimed at a crawl: the goal is missed
    slow = _rows("healthy", [100] * 3, [600] * 3, [2048] * 3) + _rows("throttled", [2000] * 3, [600] * 3, [2048] * 3)
    assert "(NOT met)" in goal_line(summarize_throttled(slow, [2048])[0])


def test_floor_uses_the_bytes_lmcache_retrieved() -> None:
    read = {"raw_read_bytes": 2**28, "raw_read_ms": 200.0, "raw_read_gbps": 2**28 / 0.2 / 1e9}
    f = floor_fields(read, {"retrieved_gib": 0.25, "retrieve_gbps": 2**28 / 0.4 / 1e9})
    assert f["floor_ms"] == pytest.approx(200.0)
    assert f["lmcache_over_raw"] == pytest.approx(0.5)
    assert floor_fields({}, {"retrieved_gib": 0.25}) == {}
