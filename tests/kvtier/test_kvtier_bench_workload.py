"""`kvtier bench workload --quick`: the multi-turn fleet benchmark end to end at a tiny size. 2 tiny vLLM CPU
engines (started twice: vLLM alone for the baseline, then with LMCache + l2fs for the L2 arms), 3 arms, a few
sessions with returning users. Checks what the benchmark's figures rest on: every arm ran, every request was
answered, L2 hits (LMCache's own counter on the replicas' /metrics) appear where L2 is on and nowhere in the
baseline (which has no KV connector at all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.workload import ARMS, make_plan, plan_order

ROOT = Path(__file__).resolve().parents[2]


def _plan(seed: int) -> Any:
    return make_plan(seed, rate=1.0, sessions=12, docs=3, doc_tokens=300, turns=2, think_s=1.0, return_share=0.5,
                     return_gap=3, question_words=5, nonce="n",
                     encode=lambda s: s.split(), decode=lambda ids: " ".join(ids))


@pytest.mark.unit
def test_schedule_is_seeded_and_users_return_after_the_gap() -> None:
    a, b, c = _plan(1), _plan(1), _plan(2)
    key = [(s.arrival, s.user.uid, s.returning, s.questions) for s in a.sessions]
    assert key == [(s.arrival, s.user.uid, s.returning, s.questions) for s in b.sessions]
    assert key != [(s.arrival, s.user.uid, s.returning, s.questions) for s in c.sessions]
    back = [s for s in a.sessions if s.returning]
    assert back, "no returning user in 12 arrivals at a 0.5 share"
    for s in back:  # the same user object (its history), after its earlier visit and at least the gap later
        assert s.after is not None and s.after.user is s.user and s.index - s.after.index >= 3
    assert all(len(d.split()) >= 300 for d in a.docs)
    arrivals = [s.arrival for s in a.sessions]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


@pytest.mark.unit
def test_arms_run_tier_by_tier_and_rotate_within_a_tier() -> None:
    order = plan_order(list(ARMS), [0.1, 0.2], [2048], (448, 0.2))
    tiers = [ARMS[a][0] for a, _ in order]
    changes = sum(1 for x, y in zip(tiers, tiers[1:], strict=False) if x != y)
    assert changes == 3  # none -> l1 -> plugin -> mount: three restarts
    plugin = [a for a, st in order if ARMS[a][0] == "plugin" and st.rate == 0.1 and st.context == 2048]
    plugin2 = [a for a, st in order if ARMS[a][0] == "plugin" and st.rate == 0.2 and st.context == 2048]
    assert sorted(plugin) == sorted(plugin2) and plugin != plugin2
    assert len(order) == len(ARMS) * 3


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> tuple[int, dict[str, Any], str, Path]:
    d = tmp_path_factory.mktemp("workload")
    out = d / "out"
    p = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "workload", "--quick", "--model", str(tiny_model),
                        "--dir", str(d / "stack"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    summary = json.loads((out / "workload.json").read_text()) if (out / "workload.json").exists() else {}
    return p.returncode, summary, p.stdout + p.stderr, out


@pytest.mark.vllm
def test_quick_workload_every_arm_answered_and_l2_hits_only_where_l2_is_on(
        quick: tuple[int, dict[str, Any], str, Path]) -> None:
    rc, summary, text, out = quick
    assert rc == 0, text[-4000:]
    steps = {s["arm"]: s for s in summary["summary"]["steps"]}
    assert set(steps) == {"baseline", "+L2 plugin", "L2 prefixaware"}, text[-2000:]
    for arm, s in steps.items():
        assert s["requests"] > 0 and s["ok"] == s["sent"] == s["requests"], (arm, s)
        assert s["returns"] >= 1, (arm, "no returning user was measured")
    base = steps["baseline"]
    assert base["ext_hit_tokens"] == 0 and not base["l2_hit_tokens"], base
    # round-robin spreads a document's users over both replicas: the second one loads it from L2
    assert steps["+L2 plugin"]["l2_hit_tokens"] > 0, steps["+L2 plugin"]
    assert steps["L2 prefixaware"]["l2_hit_tokens"] is not None, steps["L2 prefixaware"]  # LMCache's counter read
    raw = summary["raw"]
    assert {r["arm"] for r in raw} == set(steps) and all(r["ok"] for r in raw)
    assert (out / "workload.csv").exists()
    assert (out / "workload_ttft_cdf.png").stat().st_size > 0 and (out / "workload_load.png").stat().st_size > 0
    assert "per arm against the baseline" in text
