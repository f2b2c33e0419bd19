"""`kvtier bench cross-pod` over HTTP reports a miss as a miss: two test replicas (kvtier.devstack.testreplica,
real OpenAI-compatible servers, no vLLM) keep separate prefix caches and share no L2, so B must show 0 hit
tokens while A's repeat shows its own cache hit; they report usage.cached_tokens but not vLLM's connector
counters, so every row's evidence is `usage` and the bench says the counters are missing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from l2fs import procs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[list[str]]:
    d = tmp_path_factory.mktemp("nohit")
    started, urls = [], []
    try:
        for name in ("a", "b"):
            log = d / f"{name}.log"
            p = procs.spawn([sys.executable, "-m", "kvtier.devstack.testreplica", "--port", "0", "--model", "tiny",
                             "--tokenizer", str(tiny_model)], log)
            started.append(p)
            urls.append(procs.wait_ready(p, procs.log_match(log, r"listening on (http://\S+)"), timeout=60,
                                         what=f"test replica {name}", log_path=log))
        yield urls
    finally:
        for p in started:
            procs.stop(p)


def test_no_shared_l2_means_no_hit_on_b(replicas: list[str], tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "cross-pod", "--replica-a", replicas[0],
                        "--replica-b", replicas[1], "--tokenizer", str(tiny_model), "--lengths", "512",
                        "--reps", "2", "--store-wait", "0", "--out", str(out)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads((out / "cross_pod.json").read_text())
    (row,) = res["summary"]["rows"]
    assert res["summary"]["model"] == "tiny"  # from A's /v1/models
    assert row["reps"] == 2 and row["b_hit_tokens_min"] == 0 and row["b_hit_pct_full_chunks"] == 0.0, row
    assert row["b_evidence"] == ["usage"] and row["b_external_hit_tokens_min"] is None
    assert row["cold_hit_tokens_max"] == 0
    warm = [x for x in res["raw"] if x["arm"] == "L0/L1 hit A"]
    assert len(warm) == 2 and all(x["hit_tokens"] == x["cached_tokens"] > 0 for x in warm), warm
    assert any("vllm:external_prefix_cache_hits_total" in n for n in res["summary"]["notes"])
    assert "0/512" in next(ln for ln in r.stdout.splitlines() if ln.startswith("|    512 |"))
    assert "goal: cross-pod hit 100% of full chunks -> min over lengths 0.0%" in r.stdout
