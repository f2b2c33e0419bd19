"""The cross-pod hit in mount mode across network namespaces, started as `kvtier up --netns --mode mount` does
(the same `Stack`): two vLLM CPU replicas, replica-1 on node-1 and replica-2 on node-2, each node with its own
l2fs worker and its own FUSE mount, stock LMCache `fs://` on that mount (no l2fs plugin in the engines).

Replica A (node-1) prefills a 2,100-token prompt cold and LMCache writes its chunks through node-1's mount, so
they are l2fs files on node-1. Replica B (node-2), which never saw the prompt, loads them through node-2's
mount: the same greedy tokens and logprobs, and the chunk bytes crossed the link (worker-1 served them,
node-2's veth received them), not a shared local directory. Replaces the loopback twin
tests/mount/test_mount_crosspod.py.

The same in plugin mode (`kvtier up --netns`, LMCache + our native l2fs connector in each engine, its client on
the replica's node): A's chunks are l2fs files on node-1 (local-first), B loads them through its own
connector's client on node-2, and the bytes crossed the link (worker-1's metrics, node-2's veth). It replaced
the loopback twin tests/connector/test_connector_crosspod.py (its corruption test moved here too).
Run: flock /tmp/kvtier-vllm.lock .venv/bin/pytest tests/netns/test_netns_crosspod.py
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
from polling import wait_until
from rotation import of_the_day

from kvtier.up import Stack

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

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


@pytest.fixture(scope="module", params=of_the_day([pytest.param("mount", marks=pytest.mark.fuse, id="mount"),
                                                  pytest.param("plugin", id="plugin")]))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          tiny_model: Path) -> Iterator[Stack]:
    """The two-replica --netns stack in that mode (one mode at a time: module scope, parametrized)."""
    require_host()
    if request.param == "mount" and (not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None):
        pytest.skip("needs /dev/fuse and fusermount3")
    base = tmp_path_factory.mktemp(f"netns-crosspod-{request.param}")
    with Stack(base, replicas=2, workers=2, model=str(tiny_model), strategy=None, l1_gb=0.5, kv_cache_gb=1,
               mode=request.param, netns=True) as st:
        yield st


def _check_layout(stack: Stack, mode: str) -> dict:
    a, b = stack.replicas
    assert (a.node_id, b.node_id) == ("node-1", "node-2")
    state = json.loads(stack.state_path.read_text())
    assert state["mode"] == mode and state["netns"]["prefix"] == stack.net.prefix
    for r, n in zip(state["replicas"], stack.net.nodes, strict=True):  # each replica bound to its node
        assert r["bind_url"].startswith(f"http://{n.addr}:")
        if mode == "mount":
            assert r["mount"] == state["mounts"][n.name]
    return state


def _b_loads_over_the_link(stack: Stack, ids: list[int], cold: tuple[list, list], chunk_bytes: int) -> None:
    """Replica B (node-2) serves the prompt from L2: every full chunk retrieved, the same greedy tokens and
    logprobs as A's cold run, and at least the chunk bytes served by worker-1 and received by node-2."""
    b = stack.replicas[1]
    full = N_TOKENS // CHUNK * CHUNK
    served0, rx0 = _bytes_read(stack, 0), stack.net.link_stats("node-2")["rx_bytes"]
    n_retr = len(b.lmcache_retrievals())
    _, tokens, lp = b.stream_greedy(ids, max_tokens=MAX_NEW)
    assert b.lmcache_hits()[-1][1:] == (N_TOKENS, full)
    retr = b.lmcache_retrievals()
    assert len(retr) == n_retr + 1 and retr[-1]["tokens"] == full
    assert tokens == cold[0]
    assert max(abs(x - y) for x, y in zip(lp, cold[1], strict=True)) <= 1e-4
    # the chunks came over node-2's link from node-1's worker
    assert _bytes_read(stack, 0) - served0 >= chunk_bytes
    assert stack.net.link_stats("node-2")["rx_bytes"] - rx0 >= chunk_bytes


def test_cross_pod_hit_crosses_the_link(stack: Stack, tiny_model: Path) -> None:
    mode = stack.mode
    state = _check_layout(stack, mode)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    a = stack.replicas[0]
    ids = _ids(7, vocab)
    n_chunks = N_TOKENS // CHUNK
    with stack.cluster.client() as c:  # through the host forwarder: metadata only
        before = set(c.walk(state["kv_prefix"])) if mode == "plugin" else set()
        _, cold_tokens, cold_lp = a.stream_greedy(ids, max_tokens=MAX_NEW)
        assert a.lmcache_hits()[-1][1:] == (N_TOKENS, 0)
        if mode == "mount":
            m1, m2 = Path(state["mounts"]["node-1"]), Path(state["mounts"]["node-2"])
            wait_until(lambda: len(_chunk_files(m1)) >= n_chunks, 60, 0.2,
                       message=lambda: f"only {len(_chunk_files(m1))} chunks reached node-1's mount")
            sizes = [f.stat().st_size for f in _chunk_files(m1)]
            infos = [c.stat("/" + str(_chunk_files(m1)[0].relative_to(m1)))]
        else:
            def written() -> dict:
                return {p: i for p, i in c.walk(state["kv_prefix"]).items() if p not in before}

            new = wait_until(lambda: got if len(got := written()) >= n_chunks else None, 60, 0.2,
                             message=lambda: f"only {len(written())} chunks written by A's connector")
            sizes, infos = [i.size for i in new.values()], list(new.values())
    # they are l2fs files on node-1 (the writer's node): B must fetch them over its link
    assert all(i is not None and i.nodes == ["node-1"] for i in infos), infos
    _b_loads_over_the_link(stack, ids, (cold_tokens, cold_lp), n_chunks * max(sizes))
    if mode == "mount":
        assert len(_chunk_files(m2)) >= n_chunks  # node-2's mount shows the same l2fs files


CHUNK_FILE_BYTES = 28 + 2 * 4 * CHUNK * 128 * 4  # RemoteMetadata header + one fp32 chunk of the tiny model


def test_corrupted_l2_chunk_is_a_miss_and_output_stays_correct(stack: Stack, tiny_model: Path) -> None:
    """Plugin mode: one flipped byte in a block on node-1's disk; replica B on node-2 must not load that
    chunk (the l2fs CRC check makes it a miss) and its answer stays the cold one. (Moved here from the
    loopback stack of tests/connector, which this module's plugin stack replaces.)"""
    if stack.mode != "plugin":
        pytest.skip("plugin mode: a damaged block read through the FUSE mount is tests/mount's subject")
    a, b = stack.replicas
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    ids = _ids(8, vocab)
    full = N_TOKENS // CHUNK * CHUNK
    t_before = time.time()
    _, cold_tokens, cold_lp = a.stream_greedy(ids, max_tokens=MAX_NEW)  # cold on A: recompute + store
    assert a.lmcache_hits()[-1][1:] == (N_TOKENS, 0)

    def fresh_blocks() -> list[Path]:
        return sorted((f for w in stack.cluster.workers for f in Path(w.data_dir).rglob("*")
                       if f.is_file() and f.stat().st_mtime >= t_before and f.stat().st_size == CHUNK_FILE_BYTES),
                      key=lambda f: f.stat().st_mtime)

    wait_until(lambda: len(fresh_blocks()) >= full // CHUNK, 60, 0.2,
               message=lambda: f"only {len(fresh_blocks())} chunk blocks reached the workers")
    victims = fresh_blocks()
    victim = victims[len(victims) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    n_retr = len(b.lmcache_retrievals())
    _, tokens, lp = b.stream_greedy(ids, max_tokens=MAX_NEW)
    assert tokens == cold_tokens
    assert max(abs(x - y) for x, y in zip(lp, cold_lp, strict=True)) <= 1e-4
    new = b.lmcache_retrievals()[n_retr:]
    assert not new or new[-1]["tokens"] < full  # the corrupted chunk (and what follows) was not loaded
