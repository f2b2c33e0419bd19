"""The one streamed chat turn the multi-turn benches (`kvtier bench workload`, `kvtier bench routing`) send,
against the test replica (a real HTTP server with vLLM's streaming and usage shape): TTFT is the first token,
usage and the answer come back for the next turn's history, and faults are results, not exceptions."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.bench.common import stream_chat
from l2fs import procs
from l2fs.common import free_port

ROOT = Path(__file__).resolve().parents[2]


def _replica(tmp: Path, name: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    log = tmp / f"{name}.log"
    p = procs.spawn([sys.executable, "-m", "kvtier.devstack.testreplica", "--port", "0", *args], log,
                    env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    try:
        return p, procs.wait_ready(p, procs.log_match(log, r"listening on (http://\S+)"), timeout=60,
                                   what=name, log_path=log)
    except BaseException:
        procs.stop(p, grace=5)
        raise


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("stream")
    good = _replica(tmp, "good", "--prefill-us-per-token", "300", "--decode-ms-per-token", "40")
    bad = _replica(tmp, "bad", "--fault", "500")
    yield good[1], bad[1]
    for p, _ in (good, bad):
        procs.stop(p, grace=5)


def test_a_turn_reports_first_token_usage_and_answer_and_the_next_turn_hits(replicas: tuple[str, str]) -> None:
    url, _ = replicas
    messages = [{"role": "system", "content": "doc " * 200}, {"role": "user", "content": "q1"}]
    with httpx.Client(timeout=30) as http:
        r = stream_chat(http, url, "test-model", messages, 5, "user-1")
        assert r["ok"] and not r["error"], r
        assert r["output_tokens"] == 5 and r["text"] == " t0 t1 t2 t3 t4", r
        # 4 gaps of 40 ms between the 5 tokens come after the first one: TTFT is not the end of the stream
        assert r["e2e_ms"] - r["ttft_ms"] >= 4 * 40 * 0.9, r
        assert r["tpot_ms"] >= 40 * 0.9 and r["prompt_tokens"] > 200, r
        first_cached = r["cached_tokens"]
        messages += [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": "q2"}]
        r2 = stream_chat(http, url, "test-model", messages, 3, "user-1", exact_length=False)
    assert r2["ok"] and r2["output_tokens"] == 3 and r2["prompt_tokens"] > r["prompt_tokens"], r2
    assert r2["cached_tokens"] > first_cached, (r, r2)  # the history's prefix is the replica's cache hit


def test_faults_are_results_not_exceptions(replicas: tuple[str, str]) -> None:
    _, bad = replicas
    msgs = [{"role": "user", "content": "hello"}]
    with httpx.Client(timeout=10) as http:
        r = stream_chat(http, bad, "test-model", msgs, 2, "u")
        assert not r["ok"] and r["error"].startswith("HTTP 500") and r["ttft_ms"] is None, r
        down = stream_chat(http, f"http://127.0.0.1:{free_port()}", "test-model", msgs, 2, "u")
    assert not down["ok"] and "Connect" in down["error"] and down["tpot_ms"] is None, down
