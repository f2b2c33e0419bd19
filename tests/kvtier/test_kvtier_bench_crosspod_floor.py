"""The cross-pod bench's raw cross-node read (the floor of B's L2 load): it reads exactly the chunk files a row
added, from B's node, on a real l2fs cluster."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.bench.cross_pod import LocalProbe
from l2fs.testing.cluster import LocalCluster

PREFIX = "/kvtier/kv"


def test_raw_read_reads_the_rows_new_chunks_from_the_other_node(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(2)
    a = cluster.client("node-1")  # replica A's node: local-first, the chunks sit on node-1
    probe = LocalProbe(cluster.master, {}, kv_prefix=PREFIX, reader_node="node-2")
    try:
        a.put(f"{PREFIX}/model/old.data", b"x" * 1000)  # an earlier row's chunk: not this row's bytes
        probe.start_row()
        for i in range(3):
            a.put(f"{PREFIX}/model/c{i}.data", bytes([i]) * (1 << 20))
        assert all(a.stat(f"{PREFIX}/model/c{i}.data").nodes == ["node-1"] for i in range(3))
        got = probe.raw_read()
        assert got["raw_read_files"] == 3 and got["raw_read_bytes"] == 3 << 20
        assert got["raw_read_gbps"] > 0
        probe.start_row()
        assert probe.raw_read() == {}  # nothing new: nothing measured
    finally:
        probe.close()
        a.close()
