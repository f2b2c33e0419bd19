"""Client.locate_many: one StatMany locates a batch, so the reads after it do no Stat RPC each."""

from __future__ import annotations

import os
import time

import pytest
from l2fs_helpers import master_rpcs

from l2fs.client import AsyncClient, Client, InvalidPath
from l2fs.common import free_port
from l2fs.testing.cluster import LocalCluster


def _delta(before: dict[str, float], after: dict[str, float], method: str) -> float:
    return after.get(method, 0) - before.get(method, 0)


@pytest.mark.parametrize("node", ["node-1", "elsewhere"], ids=["short-circuit", "remote-tcp"])
def test_locate_many_then_reads_do_no_stat(cluster: LocalCluster, node: str) -> None:
    w = cluster.client(node_id="node-1")
    c = cluster.client(node_id=node)
    paths = [f"/locate/{node}/c{i}" for i in range(4)]
    datas = [os.urandom(200_000 + i) for i in range(3)]
    for p, d in zip(paths, datas, strict=False):  # the last path is never written
        w.put(p, d)
    before = master_rpcs(cluster)
    assert c.locate_many(paths) == 3
    buf = bytearray(300_000)
    assert c.get_into(paths[0], buf) == len(datas[0]) and buf[:len(datas[0])] == datas[0]
    assert c.get(paths[1]) == datas[1]
    assert c.get(paths[3]) is None  # known missing: a miss without asking the master again
    after = master_rpcs(cluster)
    assert _delta(before, after, "StatMany") == 1
    assert _delta(before, after, "Stat") == 0
    # each location is used once: the next read of the same path asks the master again
    assert c.get(paths[1]) == datas[1]
    assert _delta(after, master_rpcs(cluster), "Stat") == 1
    w.close()
    c.close()


def test_locate_many_stays_correct_after_changes(cluster: LocalCluster) -> None:
    c = cluster.client(node_id="elsewhere")
    gone, late, kept = "/locate/chg/gone", "/locate/chg/late", "/locate/chg/kept"
    c.put(gone, b"g" * 1000)
    c.put(kept, b"k" * 1000)
    assert c.locate_many([gone, late, kept]) == 2
    assert c.rm(gone)
    c.put(late, b"l" * 1000)  # written after it was located as missing
    assert c.get(gone) is None
    assert c.get(late) == b"l" * 1000
    assert c.get(kept) == b"k" * 1000
    # a block deleted behind the client's back after locate_many: the read is a miss, not an error
    other = cluster.client()
    other.put("/locate/chg/x", b"x" * 1000)
    assert c.locate_many(["/locate/chg/x"]) == 1
    other.rm("/locate/chg/x")
    time.sleep(0.5)  # the master tells the worker to drop the block
    got = c.get("/locate/chg/x")
    assert got in (None, b"x" * 1000)  # dropped already (miss) or not yet (old bytes, intact)
    assert c.get("/locate/chg/x") is None
    other.close()
    c.close()


def test_locate_many_faults_are_no_ops(cluster: LocalCluster) -> None:
    c = cluster.client()
    assert c.locate_many([]) == 0
    with pytest.raises(InvalidPath):
        c.locate_many(["/ok", "/a/../b"])
    dead = Client(f"127.0.0.1:{free_port()}", timeout=0.3)
    t0 = time.monotonic()
    assert dead.locate_many(["/a", "/b"]) == 0  # master unreachable: a hint, not an error
    assert dead.get("/a") is None
    assert time.monotonic() - t0 < 2.0
    dead.close()
    c.close()


async def test_async_locate_many(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.master, node_id="elsewhere") as ac:
        await ac.put("/locate/async/a", b"a" * 5000)
        before = master_rpcs(cluster)
        assert await ac.locate_many(["/locate/async/a", "/locate/async/b"]) == 1
        assert await ac.get("/locate/async/a") == b"a" * 5000
        assert await ac.get("/locate/async/b") is None
        assert _delta(before, master_rpcs(cluster), "Stat") == 0
