"""`kvtier bench cross-pod --replica-a URL --replica-b URL`: the benchmark as it runs against deployed pods, i.e.
over HTTP only. Two vLLM CPU replicas on two l2fs nodes are started once for the module (kvtier's own Stack,
no router); the bench then runs in a subprocess that is given nothing but the two URLs and the model name:
another cwd and HOME, no L2FS_/LMCACHE_/KVTIER_ variables and, when the tests run as root, the user `nobody`,
who cannot read the stack's dir (up.json, replica logs, l2fs data) at all. B's row must still show the L2 hit
from /metrics and usage.cached_tokens evidence, and the output must be well-formed.
"""

from __future__ import annotations

import csv
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm
LENGTH = 1024  # 4 full LMCache chunks; vLLM computes the last token itself, so 1023 tokens can be loaded


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Any]:
    from kvtier.up import Stack, StackState

    d = tmp_path_factory.mktemp("xpod-http")
    with Stack(d, replicas=2, workers=2, model=str(tiny_model), strategy=None, l1_gb=0.5) as s:
        yield StackState.load(s.state_path)


def _outsider(scratch: Path) -> tuple[list[str], dict[str, Any]]:
    """(command prefix, subprocess.run kwargs) for a process that only knows what it is told: own cwd/HOME, none
    of the stack's environment and, where root can drop to `nobody` (setpriv), no right to read the stack's
    files. setpriv and not subprocess's user=: the venv's interpreter may sit under root's home, which only
    setpriv's exec (path looked up before the credentials change) reaches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("L2FS_", "LMCACHE_", "KVTIER_"))}
    env.update(HOME=str(scratch), MPLCONFIGDIR=str(scratch / "mpl"))
    kw: dict[str, Any] = {"cwd": scratch, "env": env, "capture_output": True, "text": True}
    if os.geteuid() == 0 and shutil.which("setpriv"):
        nobody = pwd.getpwnam("nobody")
        prefix = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
        probe = subprocess.run([*prefix, sys.executable, "-c", "import kvtier.bench.cross_pod, matplotlib"],
                               timeout=120, **kw)
        if probe.returncode == 0:
            return prefix, kw
    return [], kw


def test_http_only_bench_shows_the_cross_pod_hit(stack: Any) -> None:
    a, b = stack.replicas[0], stack.replicas[1]
    assert a.node_id != b.node_id
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-xpod-http-"))  # outside pytest's root-only tmp
    scratch.chmod(0o777)
    try:
        prefix, kw = _outsider(scratch)
        if prefix:  # the isolation is real: the outsider cannot read a replica log
            peek = subprocess.run([*prefix, sys.executable, "-c", f"open({str(a.log_path)!r}).read(1)"],
                                  timeout=60, **kw)
            assert peek.returncode != 0 and "Permission" in peek.stderr, peek.stderr
        else:
            print("\nnot root or no setpriv: the bench runs with its own cwd/HOME/env only")
        out = scratch / "out"
        r = subprocess.run([*prefix, sys.executable, "-m", "kvtier.cli", "bench", "cross-pod", "--replica-a", a.url,
                            "--replica-b", b.url, "--model", stack.model, "--lengths", str(LENGTH), "--reps", "1",
                            "--out", str(out)], timeout=600, **kw)
        assert r.returncode == 0, r.stdout + r.stderr[-4000:]
        res = json.loads((out / "cross_pod.json").read_text())
        raw_csv = list(csv.DictReader((out / "cross_pod.csv").open()))
        png = (out / "cross_pod.png").stat().st_size
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    s = res["summary"]
    assert s["mode"] == "http" and s["replica_a"] == a.url and s["replica_b"] == b.url and s["model"] == stack.model
    (row,) = s["rows"]
    assert row["prompt_tokens"] == LENGTH and row["hittable_tokens"] == LENGTH - 1
    # B never saw the prompt: every loadable token came through the connector (L2), by both kinds of evidence
    assert row["b_hit_tokens_min"] == row["b_external_hit_tokens_min"] == row["b_cached_tokens_min"] == LENGTH - 1
    assert row["b_evidence"] == ["metrics+usage"], row  # and nothing from logs: it had none
    assert row["cold_hit_tokens_max"] == 0 and row["same_output_all"], row
    assert row["b_hit_pct_full_chunks"] == 100.0
    assert s["notes"] == []

    by_arm = {x["arm"]: x for x in res["raw"]}
    assert list(by_arm) == ["cold A", "L2 hit B", "L0/L1 hit A"] and len(raw_csv) == 3
    cold, hit = by_arm["cold A"], by_arm["L2 hit B"]
    assert cold["hit_tokens"] == cold["cached_tokens"] == cold["external_hit_tokens"] == 0
    assert hit["evidence"] == "metrics+usage" and hit["metrics_usage_agree"] is True
    assert hit["l0_hit_tokens"] == 0  # B's own prefix cache had nothing: the hit is external
    assert "l2_new_bytes" not in hit and "lmcache_hit_tokens" not in hit  # no local probe in HTTP mode
    assert all(x["ttft_ms"] > 0 for x in res["raw"])
    assert [x["evidence"] for x in raw_csv] == ["metrics+usage"] * 3

    # the printed table: one row per length with the evidence it used
    lines = r.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("|") and "B evidence" in ln)
    body = [ln for ln in lines if ln.startswith(f"| {LENGTH:>6} |")]
    assert len(body) == 1 and header.count("|") == body[0].count("|")
    assert f"{LENGTH - 1}/{LENGTH}" in body[0] and "metrics+usage" in body[0]
    assert png > 10_000
