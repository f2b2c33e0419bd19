"""Bad input at the engine level (real vLLM CPU engines, real LMCache, real l2fs):

* an l2fs master that is unreachable at start-up: the replica starts, serves from L1 only, logs one clear
  warning, and repeats are L1 hits;
* negative control for the KV comparison: a replica whose CPU connector writes zeros on load
  (KVTIER_CPU_CONNECTOR_FAULT=zero_load) produces different tokens/logprobs from the recompute, so the
  exactness checks in tests/netns/test_netns_crosspod.py can fail.

Run: flock /tmp/kvtier-vllm.lock .venv/bin/pytest tests/connector/test_connector_faults.py -m vllm
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from connector import keys as ckeys
from kvtier.devstack.replica import start_replica
from l2fs.common import free_port
from l2fs.testing.cluster import LocalCluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

VOCAB = 7000  # the tiny model's tokenizer has 7077 tokens; random ids stay below

N_TOKENS = 1100
FULL = N_TOKENS // 256 * 256


def ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(N_TOKENS)]


def test_unreachable_master_at_startup_is_l1_only(tmp_path: Path, tiny_model: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    rep = start_replica(tiny_model, free_port(), l2fs_master=dead, node_id="node-1", l1_gb=0.5, kv_cache_gb=1,
                        log_path=tmp_path / "dead.log")
    try:
        # one engine process (connector.config: vLLM's `uni` executor on CPU), no separate worker process
        engines = [k.name() for k in psutil.Process(rep.proc.pid).children(recursive=True)
                   if k.name().startswith("VLLM::")]
        assert engines == ["VLLM::EngineCore"], engines
        p = ids(11)
        _, cold, cold_lp = rep.stream_greedy(p, max_tokens=8)
        _, warm, warm_lp = rep.stream_greedy(p, max_tokens=8)
        assert rep.lmcache_hits()[-1][1:] == (N_TOKENS, FULL)  # L1 still works
        assert warm == cold and max(abs(a - b) for a, b in zip(warm_lp, cold_lp, strict=True)) <= 1e-4
        for i in range(3):
            rep.stream_greedy(ids(20 + i), max_tokens=1)
        log = rep.log_text()
        msg = f"kvtier: l2fs master {dead} unreachable"
        assert log.count(msg) == 1, [ln for ln in log.splitlines() if "unreachable" in ln]  # one warning
        assert "Traceback" not in log
    finally:
        rep.stop()


def test_negative_control_zeroed_kv_changes_output(tmp_path: Path, tiny_model: Path,
                                                   make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(2)
    a = start_replica(tiny_model, free_port(), l2fs_master=cluster.master, node_id="node-1", l1_gb=0.5,
                      kv_cache_gb=1, log_path=tmp_path / "a.log")
    try:
        p = ids(12)
        _, ref, ref_lp = a.stream_greedy(p, max_tokens=8)
        c = cluster.client()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            files = c.ls(ckeys.model_dir("/kvtier/kv", str(tiny_model)))
            if len([f for f in files if f.path.endswith(".data")]) >= FULL // 256:
                break
            time.sleep(0.2)
        c.close()
    finally:
        a.stop()
    bad = start_replica(tiny_model, free_port(), l2fs_master=cluster.master, node_id="node-2", l1_gb=0.5,
                        kv_cache_gb=1, log_path=tmp_path / "bad.log",
                        extra_env={"KVTIER_CPU_CONNECTOR_FAULT": "zero_load"})
    try:
        _, got, got_lp = bad.stream_greedy(p, max_tokens=8)
        assert bad.lmcache_hits()[-1][1:] == (N_TOKENS, FULL)  # it did load from L2 ...
        diff = max(abs(x - y) for x, y in zip(got_lp, ref_lp, strict=True))
        assert got != ref or diff > 1e-3  # ... and the comparison sees the damage
    finally:
        bad.stop()
