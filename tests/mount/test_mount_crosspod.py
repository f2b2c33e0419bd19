"""The cross-pod hit in mount mode: two vLLM CPU replicas whose LMCache uses its stock `fs` connector on two
FUSE mounts (node-1, node-2) of one l2fs cluster. No l2fs plugin is loaded in the engines.

Replica A prefills a 2,100-token prompt (cold) and LMCache writes its chunks through mount 1; replica B, which
never saw the prompt, loads them through mount 2 and must produce the same greedy tokens and logprobs.
Run: flock /tmp/kvtier-vllm.lock .venv/bin/pytest tests/mount/test_mount_crosspod.py -m vllm
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mount_helpers import Mount, start_mount

from kvtier.devstack.replica import Replica, start_replica
from l2fs.local import LocalCluster

pytestmark = [pytest.mark.vllm, pytest.mark.fuse, pytest.mark.timeout(1500)]

N_TOKENS = 2100  # 8 full chunks of 256 + a partial one
CHUNK = 256
MAX_NEW = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(seed: int, vocab: int, n: int = N_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _chunk_files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(root) for f in fs if f.endswith(".data")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory,
          tiny_model: Path) -> Iterator[tuple[LocalCluster, Mount, Replica, Replica, int]]:
    base = tmp_path_factory.mktemp("mount-crosspod")
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    with LocalCluster(base / "l2fs", workers=2) as cluster:
        mounts: list[Mount] = []
        reps: list[Replica] = []
        try:
            for i, node in enumerate(("node-1", "node-2")):
                mounts.append(start_mount(base / f"mnt{i + 1}", cluster.master, "--node-id", node))
            for m, node in zip(mounts, ("node-1", "node-2"), strict=True):
                reps.append(start_replica(tiny_model, _port(), mount_path=str(m.path), node_id=node, l1_gb=0.5,
                                          kv_cache_gb=1, log_path=base / f"{node}.log"))
                reps[-1].completion(_ids(99, vocab, 16), max_tokens=2)  # warm-up (no full chunk: stores nothing)
            yield cluster, mounts[0], reps[0], reps[1], vocab
        finally:
            for r in reps:
                r.stop()
            for m in mounts:
                m.stop()


def test_cross_pod_hit_through_two_mounts(stack: tuple[LocalCluster, Mount, Replica, Replica, int]) -> None:
    cluster, m1, a, b, vocab = stack
    ids = _ids(7, vocab)
    full = N_TOKENS // CHUNK * CHUNK
    ttft_a, cold_tokens, cold_lp = a.stream_greedy(ids, max_tokens=MAX_NEW)
    assert a.lmcache_hits()[-1][1:] == (N_TOKENS, 0)
    deadline = time.monotonic() + 60
    while len(_chunk_files(m1.path)) < full // CHUNK:
        assert time.monotonic() < deadline, f"only {len(_chunk_files(m1.path))} chunks reached the mount"
        time.sleep(0.2)
    # they are l2fs files on node-1 (the writer's node), not files in some local directory
    c = cluster.client()
    rel = "/" + str(_chunk_files(m1.path)[0].relative_to(m1.path))
    info = c.stat(rel)
    assert info is not None and info.nodes == ["node-1"]

    n_retr = len(b.lmcache_retrievals())
    ttft_b, tokens, lp = b.stream_greedy(ids, max_tokens=MAX_NEW)
    assert b.lmcache_hits()[-1][1:] == (N_TOKENS, full)
    retr = b.lmcache_retrievals()
    assert len(retr) == n_retr + 1 and retr[-1]["tokens"] == full
    assert tokens == cold_tokens
    assert max(abs(x - y) for x, y in zip(lp, cold_lp, strict=True)) <= 1e-4
    print(f"\nmount mode: TTFT cold A {ttft_a * 1000:.0f} ms, cross-pod B {ttft_b * 1000:.0f} ms "
          f"({ttft_a / ttft_b:.1f}x)")
