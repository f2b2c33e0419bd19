"""LMCache multiprocess mode with vLLM CPU engines, as `kvtier up --lmcache-mode mp` starts it: two "pods", each
a vLLM CPU replica on LMCache's own MP connector (`lmcache.integration.vllm.lmcache_mp_connector`, loaded by
vLLM's kv-transfer-config `kv_connector_module_path`, engine_driven transfer) with its own `lmcache server` (the
webhook's sidecar layout) running kvtier's L2 adapter, on nodes node-1 / node-2 of a real l2fs cluster.

Replica 1 computes a prompt cold; replica 2 (another server, empty L1) gets the same prompt: its server's own
log says the chunks came from L2, vLLM's own metric counts them as external prefix-cache hits, and the greedy
outputs are identical. The stack is started once for the module (2 engines; `-m vllm`, under
flock /tmp/kvtier-vllm.lock). The parser checks are unit tests of `kvtier up`'s own argv handling.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

pytest.importorskip("lmcache")
pytest.importorskip("vllm")

from polling import wait_until
from upstack import Up, up_stack

from kvtier import contract
from kvtier import up as kup
from l2fs.client import Client

PROMPT = [(i * 7919 + 13) % 5000 + 100 for i in range(1100)]  # 4 full 256-token chunks + 76 (vocab 7077)
CHUNKS = len(PROMPT) // contract.CHUNK_SIZE
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Up]:
    with up_stack(tmp_path_factory.mktemp("up-mp"), ["--model", str(tiny_model), "--l1-gb", "0.5", "--kv-cache-gb",
                                                     "1", "--max-model-len", "4096", "--lmcache-mode", "mp"]) as u:
        yield u


def _metric(url: str, name: str) -> float:
    """Sum of one vLLM Prometheus series over its labels."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def _complete(url: str, model: str, prompt: list[int] = PROMPT) -> tuple[dict[str, Any], float, float]:
    """One greedy completion; returns its choice, the external prefix-cache hits and vLLM's TTFT it added."""
    hits0 = _metric(url, "vllm:external_prefix_cache_hits_total")
    ttft0 = _metric(url, "vllm:time_to_first_token_seconds_sum")
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text[:2000]
    return (r.json()["choices"][0], _metric(url, "vllm:external_prefix_cache_hits_total") - hits0,
            _metric(url, "vllm:time_to_first_token_seconds_sum") - ttft0)


def _prefetch_lines(log: str) -> list[str]:
    """LMCache's storage manager's own account of where a lookup's chunks came from."""
    text = _ANSI.sub("", Path(log).read_text(errors="replace"))
    return re.findall(r"Prefetch request completed \(L1\+L2\): .*", text)


@pytest.mark.vllm
def test_up_mp_state_names_a_server_per_replica(stack: Up) -> None:
    st = stack.state
    assert st["lmcache_mode"] == "mp" and st["kv_prefix"] == contract.MP_PREFIX
    assert [r["node_id"] for r in st["replicas"]] == ["node-1", "node-2"]
    servers = [r["lmcache_server"] for r in st["replicas"]]
    assert all(s and s.startswith("tcp://127.0.0.1:") for s in servers) and len(set(servers)) == 2
    for r in st["replicas"]:  # each engine's LMCache MP client registered with ITS server (engine_driven, CPU)
        assert "Registered non-GPU context" in Path(r["lmcache_server_log"]).read_text(errors="replace")


@pytest.mark.vllm
def test_cross_pod_hit_through_lmcache_mp_and_l2fs_gives_identical_greedy_output(stack: Up) -> None:
    a, b = stack.state["replicas"]
    model = stack.state["model"]
    for r in (a, b):  # warm-up: less than a chunk (nothing stored), so TTFT below is not an engine's first request
        _complete(r["url"], model, [t + 1 for t in PROMPT[:100]])
    client = Client(stack.state["l2fs_master"])

    def objects() -> int:
        return len([i for i in client.walk(contract.MP_PREFIX).values() if not i.is_dir]) \
            if client.exists(contract.MP_PREFIX) else 0

    try:
        before = objects()
        out_a, hits_a, ttft_a = _complete(a["url"], model)
        assert hits_a == 0  # cold: nothing anywhere yet
        # replica 1's server writes its chunks to l2fs in the background
        wait_until(lambda: objects() >= before + CHUNKS, timeout=120, interval=0.5)
    finally:
        client.close()
    out_b, hits_b, ttft_b = _complete(b["url"], model)
    # vLLM's own count: every full chunk came from the connector (none from vLLM's own cache: prefix caching off)
    assert hits_b == CHUNKS * contract.CHUNK_SIZE, hits_b
    # LMCache's own log on replica 2's server: all of them from L2 (its L1 was empty)
    assert any(f"{CHUNKS}/{CHUNKS} retained keys (0 L1, {CHUNKS} L2)" in ln
               for ln in _prefetch_lines(b["lmcache_server_log"])), _prefetch_lines(b["lmcache_server_log"])
    assert out_a["text"] == out_b["text"]
    assert out_a["logprobs"]["tokens"] == out_b["logprobs"]["tokens"]
    print(f"TTFT (vLLM's histogram): cold on replica 1 {ttft_a * 1000:.0f} ms, cross-pod L2 hit on replica 2 "
          f"{ttft_b * 1000:.0f} ms ({ttft_b / ttft_a:.2f}x; shared 2-core box)")


@pytest.mark.vllm
def test_sigterm_stops_replicas_and_their_lmcache_servers(stack: Up) -> None:
    children = psutil.Process(stack.proc.pid).children(recursive=True)
    servers = [c for c in children if "lmcache.cli.main" in " ".join(c.cmdline())]
    assert len(servers) == 2
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=180) == 0
    wait_until(lambda: not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE],
               timeout=60, interval=0.5)


@pytest.mark.unit
@pytest.mark.parametrize("extra", [["--mode", "mount"], ["--netns"], ["--device", "cuda"],
                                   ["--prefill-tokens-per-s", "1000"]])
def test_up_refuses_mp_with_what_it_does_not_run(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert kup.main(["--lmcache-mode", "mp", *extra]) == 2  # refused before anything starts
    err = capsys.readouterr().err
    assert "kvtier up: " in err and ("--lmcache-mode mp" in err or "MP mode" in err), err


@pytest.mark.unit
def test_up_parser_takes_lmcache_mode() -> None:
    assert kup.build_parser().parse_args([]).lmcache_mode == "inprocess"
    assert kup.build_parser().parse_args(["--lmcache-mode", "mp"]).lmcache_mode == "mp"
    with pytest.raises(SystemExit):
        kup.build_parser().parse_args(["--lmcache-mode", "sidecar"])
    with pytest.raises(ValueError, match="lmcache-mode"):
        kup.Stack(Path("/nonexistent"), lmcache_mode="mp", mode="mount")

