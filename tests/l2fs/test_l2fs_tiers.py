"""Storage tiers on one worker: new blocks land in [MEM], cold ones are demoted to the slower dir
(the master learns their new file), only the slowest tier evicts; data survives a restart."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from l2fs_helpers import wait_until

from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.testing.cluster import LocalCluster

MB = 1 << 20


def _local_path(cluster: LocalCluster, path: str) -> str:
    st = pbg.MasterStub(grpc.insecure_channel(cluster.master)).Stat(pb.PathRequest(path=path), timeout=5)
    return st.locations[0].local_path


def test_mem_tier_demotes_then_evicts(tmp_path: Path, make_cluster: Callable[..., LocalCluster]) -> None:
    mem = tmp_path / "mem"
    cl = make_cluster(1, capacity="40M", heartbeat_interval=0.2, worker_args=["--data-dir", f"[MEM]{mem}:10M"])
    c = cl.client(node_id="node-1")
    remote = cl.client(node_id="elsewhere")
    blobs = {f"/t/{i}": bytes([i]) * (2 * MB) for i in range(20)}  # 40 MiB: > MEM, ~ MEM + SSD
    for p, d in blobs.items():
        assert c.put(p, d) is True
        time.sleep(0.01)
    newest = "/t/19"
    assert _local_path(cl, newest).startswith(str(mem))  # new data in the fast tier
    # the oldest survivors were demoted: the master points at the slower dir, reads still work
    wait_until(lambda: not _local_path(cl, "/t/10").startswith(str(mem)), timeout=5)
    assert c.get("/t/10") == blobs["/t/10"]  # short-circuit at the new path
    assert remote.get("/t/10") == blobs["/t/10"]  # TCP data plane
    mem_used = sum(f.stat().st_size for f in (mem / "blocks").glob("*/*"))
    assert mem_used <= 0.9 * 10 * MB
    # 50 MiB of capacity in all, 40 MiB written: nothing had to be evicted yet
    assert all(c.exists(p) for p in blobs)
    for i in range(20, 35):  # now overflow both tiers
        assert c.put(f"/t/{i}", bytes([i]) * (2 * MB)) is True
    wait_until(lambda: not c.exists("/t/0"), timeout=5)  # the coldest left the slowest tier
    assert c.get("/t/34") == bytes([34]) * (2 * MB)
    present = [p for p in (f"/t/{i}" for i in range(35)) if c.exists(p)]
    for p in present:  # everything the master lists is readable, wherever it lives now
        assert c.get(p) is not None, p
    # a restart keeps both tiers' blocks
    before = set(present)
    cl.kill_worker(0, signal.SIGKILL)
    cl.start_worker(0)
    wait_until(lambda: {p for p in before if c.exists(p)} == before, timeout=10)
    assert c.get(present[0]) is not None
