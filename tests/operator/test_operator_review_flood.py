"""A TokenReview path that made-up tokens cannot drain (l2fs/master/identity.py): strangers sending bearer
tokens nobody issued, as fast as one process can, on the worker methods of a `--worker-identity k8s`
master, for longer than its review cache keeps a worker's identity.

Before the fix every review came out of one budget (20/s): the flood kept it empty, and once the real
workers' cached reviews expired theirs were shed too and the master declared both dead, so every read
missed. Real master and workers, a kmock TokenReview emulator (tests/operator/operator_helpers.py), the
cache TTL shortened to 3 s (--review-cache-ttl) so the flood outlasts it three times in ~10 s.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from operator_helpers import ReviewApi, review_api
from test_operator_worker_identity import ADMIN, k8s_local_cluster

from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

pytestmark = pytest.mark.k8s

TTL = 3.0  # the master's review cache TTL here (60 s by default)
FLOOD_S = 3 * TTL + 1


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ReviewApi]:
    with review_api(tmp_path) as handle:
        yield handle


@pytest.fixture
def k8s_cluster(api: ReviewApi, tmp_path: Path, make_cluster: Callable[..., Any]) -> Iterator[Any]:
    """test_operator_worker_identity's cluster (two workers with projected-token files) with a 3 s review
    cache; `.tokens`: each node's token."""
    cluster = k8s_local_cluster(make_cluster, api, tmp_path, ("--review-cache-ttl", str(TTL)))
    cluster.tokens = {node: f.read_text() for node, f in cluster.token_files.items()}
    with cluster:
        yield cluster


def _flood(master: str, stop: threading.Event, counts: list[int], k: int) -> None:
    """Heartbeats with a fresh made-up bearer token each, back to back, until stop."""
    chan = grpc.insecure_channel(master)
    hb = pbg.MasterStub(chan).Heartbeat
    n = 0
    while not stop.is_set():
        try:
            hb(pb.HeartbeatRequest(worker_id="node-1"), timeout=2,
               metadata=(("authorization", f"Bearer {secrets.token_hex(24)}"),))
        except grpc.RpcError:
            pass
        n += 1
    counts[k] = n
    chan.close()


def test_made_up_token_flood_does_not_drain_known_workers_reviews(k8s_cluster: Any, api: ReviewApi) -> None:
    """4 threads of made-up-token Heartbeats for 3x the review cache TTL: both real workers stay alive the
    whole time, every get of a stored file hits, and the workers' tokens were re-reviewed (renewed)
    rather than merely cached; the strangers' reviews that reached the API server stay within its budget."""
    data = {f"/kv/f{i}": secrets.token_bytes(40_000 + i) for i in range(4)}
    with k8s_cluster.client(token=ADMIN) as c:
        for p, d in data.items():
            assert c.put(p, d) is True
    before = {n: api.emu.seen.count(t) for n, t in k8s_cluster.tokens.items()}
    reviews_before = len(api.emu.seen)
    stop = threading.Event()
    counts = [0] * 4
    threads = [threading.Thread(target=_flood, args=(k8s_cluster.master, stop, counts, k), daemon=True)
               for k in range(4)]
    for t in threads:
        t.start()
    dead: list[tuple[float, set[str]]] = []
    misses: list[str] = []
    t0 = time.monotonic()
    try:
        with k8s_cluster.client(token=ADMIN, timeout=5) as c:
            while time.monotonic() - t0 < FLOOD_S:
                alive = {w.node_id for w in c.report().workers if w.alive}
                if alive != {"node-1", "node-2"}:
                    dead.append((round(time.monotonic() - t0, 1), alive))
                for p, d in data.items():
                    if c.get(p) != d:
                        misses.append(p)
                time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    took = time.monotonic() - t0
    flood_calls = sum(counts)
    assert flood_calls / took > 100, f"the flood reached only {flood_calls / took:.0f} calls/s"
    assert not dead, f"workers declared dead during the flood: {dead[:3]}"
    assert not misses, f"{len(misses)} gets missed during the flood"
    renewed = {n: api.emu.seen.count(t) - before[n] for n, t in k8s_cluster.tokens.items()}
    assert all(v >= 2 for v in renewed.values()), renewed
    strangers = len(api.emu.seen) - reviews_before - sum(renewed.values())
    assert strangers <= 100 + 20 * took, strangers  # burst + rate: the flood cannot make the master flood the API
