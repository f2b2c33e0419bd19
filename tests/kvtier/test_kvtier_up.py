"""`kvtier up` end to end: start the whole stack once (2 vLLM CPU replicas, l2fs, router), send a request
through the router, run the cross-pod and routing benchmarks at a tiny size against it, then SIGTERM it and
check that every process it started is gone. One engine start for the whole module (vLLM flock!)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from l2fs import procs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm


class Up:
    def __init__(self, proc: subprocess.Popen[bytes], state: dict[str, Any], dir: Path) -> None:
        self.proc, self.state, self.dir = proc, state, dir


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Up]:
    d = tmp_path_factory.mktemp("up")
    out = d / "up.out"
    # its own process group, as from a terminal; the SIGTERM test signals only `kvtier up` itself
    proc = procs.spawn([sys.executable, "-m", "kvtier.cli", "up", "--dir", str(d), "--port", "0", "--model",
                        str(tiny_model), "--l1-gb", "0.5"], out, cwd=ROOT)
    state_file = d / "up.json"
    try:
        procs.wait_ready(proc, lambda: state_file.exists() and "Ctrl-C stops everything" in out.read_text(),
                         timeout=600, what="kvtier up", log_path=out, interval=1)
    except procs.ProcessError as e:
        _kill_tree(proc)
        pytest.fail(str(e))
    u = Up(proc, json.loads(state_file.read_text()), d)
    yield u
    if proc.poll() is None:  # a test failed before the shutdown test: do not leave engines behind
        _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """`kvtier up` starts each child in its own group, so a group kill would miss them: walk the tree."""
    try:
        for c in psutil.Process(proc.pid).children(recursive=True):
            c.kill()
    except psutil.NoSuchProcess:
        pass
    proc.kill()
    proc.wait()


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
