"""Faults become misses: dead worker, restarted master/worker, corrupted block, concurrent writers."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
from l2fs_helpers import block_files, wait_until

from l2fs.testing.cluster import LocalCluster

HB_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def fcluster(cluster_factory: Callable[..., LocalCluster]) -> LocalCluster:
    return cluster_factory(2, name="faults", capacity="1G", heartbeat_timeout=HB_TIMEOUT, heartbeat_interval=0.3)


def _alive(cluster: LocalCluster) -> dict[str, bool]:
    return {w.node_id: w.alive for w in cluster.client().report().workers}


def test_dead_worker_dropped_and_reads_miss_fast(fcluster: LocalCluster) -> None:
    c = fcluster.client(node_id="node-1", timeout=2.0)
    data = os.urandom(3 << 20)
    assert c.put("/dead/a", data)
    w2 = fcluster.client(node_id="node-2")
    assert w2.put("/dead/b", data)
    assert c.stat("/dead/b").nodes == ["node-2"]
    fcluster.kill_worker(1, signal.SIGKILL)
    t0 = time.monotonic()
    assert c.get("/dead/b") is None  # worker gone: a miss, not a hang
    assert time.monotonic() - t0 < 2.5
    wait_until(lambda: c.stat("/dead/b") is None, timeout=HB_TIMEOUT + 2)
    assert time.monotonic() - t0 <= HB_TIMEOUT + 0.75  # within the timeout of the kill (+ slack: shared box)
    assert _alive(fcluster)["node-2"] is False
    assert c.get("/dead/a") == data  # the other worker is unaffected
    # the restarted worker keeps its data and re-reports it
    fcluster.start_worker(1)
    assert c.get("/dead/b") == data
    assert _alive(fcluster)["node-2"] is True


def test_worker_restart_keeps_data(fcluster: LocalCluster) -> None:
    c = fcluster.client(node_id="node-1")
    blobs = {f"/wr/{i}": os.urandom(100_000 + i) for i in range(5)}
    for p, d in blobs.items():
        assert c.put(p, d)
    fcluster.kill_worker(0, signal.SIGKILL)
    fcluster.start_worker(0)
    for p, d in blobs.items():
        assert c.get(p) == d
        assert c.stat(p).nodes == ["node-1"]


def test_master_restart_rebuilds_namespace(fcluster: LocalCluster) -> None:
    c = fcluster.client(node_id="node-2")
    c.put("/mr/keep", b"keep")
    c.put("/mr/old", b"renamed")
    c.put("/mr/dst", b"overwritten")
    c.put("/mr/gone", b"deleted")
    c.rename("/mr/old", "/mr/dst")
    assert c.rm("/mr/gone")
    before = {i.path: i.size for i in c.ls("/mr")}
    fcluster.kill_master(signal.SIGKILL)
    fcluster.start_master()
    wait_until(lambda: sum(w.alive for w in c.report().workers) == 2, timeout=10)
    assert {i.path: i.size for i in c.ls("/mr")} == before
    assert c.get("/mr/dst") == b"renamed"
    assert c.get("/mr/keep") == b"keep"
    assert c.get("/mr/gone") is None and c.get("/mr/old") is None


@pytest.mark.parametrize("short_circuit,data_plane", [(True, True), (False, False), (False, True)],
                         ids=["short-circuit", "grpc", "tcp"])
def test_corrupt_block_is_a_miss_and_dropped(fcluster: LocalCluster, short_circuit: bool,
                                             data_plane: bool) -> None:
    c = fcluster.client(node_id="node-1", short_circuit=short_circuit, data_plane=data_plane)
    path = f"/corrupt/{short_circuit}-{data_plane}"
    before = set(block_files(fcluster, 0))
    data = os.urandom(1 << 20)
    assert c.put(path, data)
    (blk,) = set(block_files(fcluster, 0)) - before
    raw = bytearray(blk.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    blk.write_bytes(raw)
    assert c.get(path) is None
    wait_until(lambda: not blk.exists() and c.stat(path) is None, timeout=5)
    assert c.put(path, data) is True  # the slot is free again


def test_concurrent_put_if_absent_publishes_one_version(fcluster: LocalCluster) -> None:
    n = 8
    payloads = [bytes([i]) * (2 << 20) for i in range(n)]
    clients = [fcluster.client(node_id=f"node-{1 + i % 2}") for i in range(n)]
    results: list[bool | None] = [None] * n
    barrier = threading.Barrier(n)

    def writer(i: int) -> None:
        barrier.wait()
        results[i] = clients[i].put("/race/one", payloads[i])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1 and results.count(False) == n - 1
    winner = payloads[results.index(True)]
    assert clients[0].get("/race/one") == winner
    assert clients[1].get("/race/one") == winner
    # losers' orphan blocks get deleted: exactly one 2 MiB block of this content remains
    def copies() -> int:
        n = 0
        for i in range(2):
            for f in block_files(fcluster, i):
                try:
                    n += f.stat().st_size == 2 << 20 and f.read_bytes()[:1] in {p[:1] for p in payloads}
                except FileNotFoundError:  # deleted while we looked
                    pass
        return n

    wait_until(lambda: copies() == 1, timeout=5)


def test_put_moves_on_from_a_dead_worker_the_master_still_lists(make_cluster: Callable[..., LocalCluster]) -> None:
    # a long heartbeat timeout: the master keeps placing on the dead worker for a while
    cl = make_cluster(2, capacity="1G", heartbeat_timeout=30)
    c = cl.client(node_id="node-2", timeout=3.0)
    cl.kill_worker(1, signal.SIGKILL)
    t0 = time.monotonic()
    assert c.put("/pm/a", b"data") is True  # local-first picks node-2, which is gone
    assert time.monotonic() - t0 < 3.0
    assert c.stat("/pm/a").nodes == ["node-1"]
    assert c.get("/pm/a") == b"data"
    cl.kill_worker(0, signal.SIGKILL)
    from l2fs.client import Unavailable
    with pytest.raises(Unavailable):
        c.put("/pm/b", b"data")
    assert time.monotonic() - t0 < 10.0


def test_stalled_master_keeps_workers_when_it_resumes(make_cluster: Callable[..., LocalCluster]) -> None:
    cl = make_cluster(1, capacity="256M", heartbeat_timeout=3.0, heartbeat_interval=0.3)
    c = cl.client(node_id="node-1")
    c.put("/stall/a", b"kept")
    cl.master_proc.send_signal(signal.SIGSTOP)
    time.sleep(4.5)  # longer than the dead-worker timeout
    cl.master_proc.send_signal(signal.SIGCONT)
    for _ in range(10):  # the worker never looks dead: no window of misses
        assert c.stat("/stall/a") is not None
        time.sleep(0.05)
    assert c.get("/stall/a") == b"kept"


def test_put_to_a_frozen_worker_ends_at_its_deadline_saying_so(make_cluster: Callable[..., LocalCluster]) -> None:
    """A worker that accepts the connection and then reads nothing (SIGSTOP): the data plane's send blocks until
    the socket's kernel timeout (EAGAIN), which the client reports as its deadline passing, not as a raw errno;
    the call ends near that deadline and nothing is published."""
    from l2fs.client import Unavailable

    cl = make_cluster(1, capacity="256M")
    c = cl.client(timeout=1.0)  # no node id: the TCP data plane, not the same-node short circuit
    assert c.put("/frozen/warm", b"x")  # the connection exists and is pooled
    cl.workers[0].proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="deadline passed"):
            c.put("/frozen/big", os.urandom(32 << 20))
        assert time.monotonic() - t0 < 1.0 + (32 << 20) / 200e6 + 3.0
    finally:
        cl.workers[0].proc.send_signal(signal.SIGCONT)
    assert c.stat("/frozen/big") is None and c.get("/frozen/warm") == b"x"
