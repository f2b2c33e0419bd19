"""`kvtier up` end to end: start the whole stack once (2 vLLM CPU replicas, l2fs, router), send a request
through the router, run the cross-pod (also HTTP-only, as against deployed pods) and routing benchmarks at a tiny
size against it, then SIGTERM it and check that every process it started is gone. One engine start for the whole module (vLLM flock!)."""

from __future__ import annotations

import csv
import json
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import pytest
from polling import wait_until
from upstack import Up, up_stack

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm
LENGTH = 1024  # HTTP-only bench: 4 full LMCache chunks; vLLM computes the last token itself, so 1023 can load


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Up]:
    # its own process group, as from a terminal; the SIGTERM test signals only `kvtier up` itself
    with up_stack(tmp_path_factory.mktemp("up"), ["--model", str(tiny_model), "--l1-gb", "0.5"]) as u:
        yield u


def test_up_prints_endpoints_and_serves_through_router(up: Up) -> None:
    out = (up.dir / "up.out").read_text()
    assert "kvtier is up" in out and up.state["router_url"] in out and "curl" in out
    assert len(up.state["replicas"]) == 2
    assert {r["node_id"] for r in up.state["replicas"]} == set(up.state["nodes"]) and len(up.state["nodes"]) == 2
    r = httpx.post(f"{up.state['router_url']}/v1/chat/completions", timeout=120, json={
        "model": up.state["model"], "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    # bad input through the router is a clear 4xx, not a crash
    bad = httpx.post(f"{up.state['router_url']}/v1/chat/completions", content=b"{not json", timeout=30,
                     headers={"content-type": "application/json"})
    assert 400 <= bad.status_code < 500


def _bench(up: Up, name: str, out: Path) -> dict[str, Any]:
    """Run `kvtier bench <name> --quick` against the running stack; its JSON result."""
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", name, "--quick", "--from-up",
                        str(up.dir / "up.json"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    return json.loads((out / f"{name.replace('-', '_')}.json").read_text())


def test_bench_cross_pod_quick(up: Up, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = _bench(up, "cross-pod", out)
    for row in res["summary"]["rows"]:
        # replica B never saw the prompt: every full chunk must come from L2, and the output must not change
        assert row["b_hit_tokens_min"] >= row["full_chunk_tokens"] > 0, row
        assert row["same_output_all"], row
        assert row["l2_bytes_p50"] > 0, row
    assert (out / "cross_pod.png").stat().st_size > 10_000
    assert (out / "cross_pod.csv").read_text().count("\n") == 1 + 3 * len(res["summary"]["rows"])


def test_bench_routing_quick(up: Up, tmp_path: Path) -> None:
    res = _bench(up, "routing", tmp_path / "out")
    arms = {a["arm"]: a for a in res["summary"]["arms"]}
    assert "prefixaware" in arms and "roundrobin" in arms and "vllm-router cache_aware" in arms
    for name, a in arms.items():
        assert a["requests_ok"] == a["requests"] > 0, (name, a)
    # shared system prompts and round-2 histories are cached somewhere (L1 or, across replicas, L2)
    assert arms["prefixaware"]["total_hit_rate"] > 0, arms["prefixaware"]


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


def test_http_only_bench_shows_the_cross_pod_hit(up: Up) -> None:
    """`kvtier bench cross-pod --replica-a URL --replica-b URL`, as against deployed pods: the bench runs in a
    subprocess given nothing but the two replicas' URLs and the model name (another cwd and HOME, no L2FS_/LMCACHE_/
    KVTIER_ variables and, as root, the user `nobody`, who cannot read the stack's dir: up.json, replica logs, l2fs
    data). B's row must still show the L2 hit from /metrics and usage.cached_tokens evidence. Runs on this module's
    stack (the bench's fresh prompt seed keeps it cold after the other benches)."""
    a, b = (SimpleNamespace(**r) for r in up.state["replicas"][:2])
    model = up.state["model"]
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
                            "--replica-b", b.url, "--model", model, "--lengths", str(LENGTH), "--reps", "1",
                            "--out", str(out)], timeout=600, **kw)
        assert r.returncode == 0, r.stdout + r.stderr[-4000:]
        res = json.loads((out / "cross_pod.json").read_text())
        raw_csv = list(csv.DictReader((out / "cross_pod.csv").open()))
        png = (out / "cross_pod.png").stat().st_size
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    s = res["summary"]
    assert s["mode"] == "http" and s["replica_a"] == a.url and s["replica_b"] == b.url and s["model"] == model
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


def _hints_by_hash(base: Path) -> dict[int, int]:
    """chunk hash -> order hint, from every l2fs worker manifest under `base` (read-only), for KV chunks."""
    from connector import keys as ckeys

    out: dict[int, int] = {}
    for manifest in base.rglob("manifest.sqlite3"):
        con = sqlite3.connect(f"file:{manifest}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT path, order_hint FROM blocks").fetchall()
        finally:
            con.close()
        for path, hint in rows:
            try:
                out[ckeys.name_to_key(path.rsplit("/", 1)[-1]).chunk_hash] = hint
            except ValueError:
                continue  # fingerprints and other files
    return out


def test_engine_stores_prompt_positions_across_an_extension(up: Up) -> None:
    """Order hints from a real engine: replica A (LMCache + the l2fs plugin) stores a prompt's chunks with their
    index in the prompt, also when a later request extends an already cached prefix (LMCache then stores only
    the new chunks, in a batch that starts in the middle of the chain), so deepest chunks are evicted first."""
    import random

    from kvtier import contract

    chunk = 256
    rng = random.Random(14)
    ids = [rng.randrange(10, 7000) for _ in range(8 * chunk + 40)]
    hashes = contract.chunk_hashes(ids[: 8 * chunk])
    url = up.state["replicas"][0]["url"]

    def complete(prompt: list[int]) -> None:
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": up.state["model"], "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text

    complete(ids[: 4 * chunk + 40])  # stores chunks 0-3
    deadline = time.monotonic() + 180  # for both waits
    wait_until(lambda: set(hashes[:4]) <= set(_hints_by_hash(up.dir)), 180, 0.3,
               message="first 4 chunks never reached l2fs")
    complete(ids)  # hits 0-3, stores only 4-7
    got = wait_until(lambda: h if set(hashes) <= set(h := _hints_by_hash(up.dir)) else None,
                     deadline - time.monotonic(), 0.3,
                     message=lambda: f"chunks 4-7 never reached l2fs: {len(_hints_by_hash(up.dir))} stored")
    assert [got[h] for h in hashes] == list(range(8))


def test_sigterm_shuts_everything_down(up: Up) -> None:
    parent = psutil.Process(up.proc.pid)
    children = parent.children(recursive=True)
    assert len(children) >= 5  # l2fs master + 2 workers + 2 replicas (+ engine cores) + router
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=120) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert not (up.dir / "up.json").exists()
    assert "all stopped" in (up.dir / "up.out").read_text()
