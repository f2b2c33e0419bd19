"""The cross-pod hit in mount mode across network namespaces, started as `kvtier up --netns --mode mount` does
(the same `Stack`): two vLLM CPU replicas, replica-1 on node-1 and replica-2 on node-2, each node with its own
l2fs worker and its own FUSE mount, stock LMCache `fs://` on that mount (no l2fs plugin in the engines).

Replica A (node-1) prefills a 2,100-token prompt cold and LMCache writes its chunks through node-1's mount, so
they are l2fs files on node-1. Replica B (node-2), which never saw the prompt, loads them through node-2's
mount: the same greedy tokens and logprobs, and the chunk bytes crossed the link (worker-1 served them,
node-2's veth received them), not a shared local directory. Replaces the loopback twin
tests/mount/test_mount_crosspod.py. Run: flock /tmp/kvtier-vllm.lock .venv/bin/pytest tests/netns/test_netns_crosspod.py
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_helpers import require_host

from kvtier.up import Stack

pytestmark = [pytest.mark.vllm, pytest.mark.fuse, pytest.mark.timeout(1500)]

N_TOKENS = 2100  # 8 full chunks of 256 + a partial one
CHUNK = 256
MAX_NEW = 16


def _ids(seed: int, vocab: int, n: int = N_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _chunk_files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(root) for f in fs if f.endswith(".data")]


def _bytes_read(stack: Stack, i: int) -> float:
    """Worker i's l2fs_worker_bytes_read_total (what it served over gRPC or its data plane), read in its node."""
    w = stack.cluster.workers[i]
    fwd = stack.net.forward(w.metrics_port, where=w.node_id)
    try:
        text = urllib.request.urlopen(f"http://{fwd.address}/metrics", timeout=5).read().decode()
    finally:
        fwd.close()
    m = re.search(r"^l2fs_worker_bytes_read_total (\S+)$", text, re.M)
    assert m, "worker metrics lack l2fs_worker_bytes_read_total"
    return float(m.group(1))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Stack]:
    require_host()
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("needs /dev/fuse and fusermount3")
    base = tmp_path_factory.mktemp("netns-crosspod")
    with Stack(base, replicas=2, workers=2, model=str(tiny_model), strategy=None, l1_gb=0.5, kv_cache_gb=1,
               mode="mount", netns=True) as st:
        yield st


def test_cross_pod_hit_through_each_nodes_mount_crosses_the_link(stack: Stack, tiny_model: Path) -> None:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    a, b = stack.replicas
    assert (a.node_id, b.node_id) == ("node-1", "node-2")
    state = json.loads(stack.state_path.read_text())
    assert state["mode"] == "mount" and state["netns"]["prefix"] == stack.net.prefix
    for r, n in zip(state["replicas"], stack.net.nodes, strict=True):  # each replica bound to its node
        assert r["bind_url"].startswith(f"http://{n.addr}:") and r["mount"] == state["mounts"][n.name]
    m1, m2 = Path(state["mounts"]["node-1"]), Path(state["mounts"]["node-2"])

    ids = _ids(7, vocab)
    full = N_TOKENS // CHUNK * CHUNK
    _, cold_tokens, cold_lp = a.stream_greedy(ids, max_tokens=MAX_NEW)
    assert a.lmcache_hits()[-1][1:] == (N_TOKENS, 0)
    deadline = time.monotonic() + 60
    while len(_chunk_files(m1)) < full // CHUNK:
        assert time.monotonic() < deadline, f"only {len(_chunk_files(m1))} chunks reached node-1's mount"
        time.sleep(0.2)
    chunk_bytes = full // CHUNK * max(f.stat().st_size for f in _chunk_files(m1))  # what B must load
    with stack.cluster.client() as c:  # they are l2fs files on node-1 (the writer's node)
        info = c.stat("/" + str(_chunk_files(m1)[0].relative_to(m1)))
    assert info is not None and info.nodes == ["node-1"]

    served0, rx0 = _bytes_read(stack, 0), stack.net.link_stats("node-2")["rx_bytes"]
    n_retr = len(b.lmcache_retrievals())
    _, tokens, lp = b.stream_greedy(ids, max_tokens=MAX_NEW)
    assert b.lmcache_hits()[-1][1:] == (N_TOKENS, full)
    retr = b.lmcache_retrievals()
    assert len(retr) == n_retr + 1 and retr[-1]["tokens"] == full
    assert tokens == cold_tokens
    assert max(abs(x - y) for x, y in zip(lp, cold_lp, strict=True)) <= 1e-4
    # the chunks came over node-2's link from node-1's worker
    assert _bytes_read(stack, 0) - served0 >= chunk_bytes
    assert stack.net.link_stats("node-2")["rx_bytes"] - rx0 >= chunk_bytes
    assert len(_chunk_files(m2)) >= full // CHUNK  # node-2's mount shows the same l2fs files
