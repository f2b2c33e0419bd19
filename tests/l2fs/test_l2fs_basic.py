"""Client API against a real two-worker cluster: data round trips, metadata ops, batch calls, asyncio."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest

from l2fs.client import AlreadyExists, AsyncClient, InvalidPath, L2fsError, NotFound
from l2fs.testing.cluster import LocalCluster

MB = 1 << 20


@pytest.mark.parametrize("node,short_circuit,data_plane", [
    ("node-1", True, True), ("node-1", False, False), ("elsewhere", True, True), ("elsewhere", True, False)],
    ids=["short-circuit", "same-node-grpc", "remote-tcp", "remote-grpc"])
def test_put_get_roundtrip(cluster: LocalCluster, node: str, short_circuit: bool, data_plane: bool) -> None:
    c = cluster.client(node_id=node, short_circuit=short_circuit, data_plane=data_plane)
    data = os.urandom(9 * MB + 123)  # several 4 MiB frames plus a tail
    path = f"/rt/{node}-{short_circuit}-{data_plane}.data"
    assert c.put(path, data) is True
    assert c.get(path) == data
    buf = bytearray(len(data) + 10)
    assert c.get_into(path, buf) == len(data)
    assert bytes(buf[:len(data)]) == data
    info = c.stat(path)
    assert info is not None and info.size == len(data) and not info.is_dir and info.crc32c != 0
    empty = f"/rt/{node}-{short_circuit}-{data_plane}.empty"
    assert c.put(empty, b"") is True
    assert c.get(empty) == b""
    c.close()


@pytest.mark.parametrize("node,short_circuit,data_plane,fd_passing", [
    ("node-1", True, True, True), ("node-1", True, True, False), ("node-1", False, False, False),
    ("elsewhere", True, True, False), ("elsewhere", True, False, False)],
    ids=["fd", "path", "same-node-grpc", "remote-tcp", "remote-grpc"])
def test_scatter_read_fills_each_buffer_and_checks_the_crc(cluster: LocalCluster, node: str, short_circuit: bool,
                                                          data_plane: bool, fd_passing: bool) -> None:
    """get_into with a list of buffers (LMCache's header + the L1 object's KV): every read path fills them in order,
    boundaries inside CRC pieces and gRPC frames included; a flipped byte in any buffer's part is a miss."""
    c = cluster.client(node_id=node, short_circuit=short_circuit, data_plane=data_plane, fd_passing=fd_passing)
    data = os.urandom(9 * MB + 123)  # CRC pieces: 1 MiB + 123, 4 MiB, 4 MiB
    path = f"/scatter/{node}-{short_circuit}-{data_plane}-{fd_passing}"
    assert c.put(path, data) is True
    head, mid, tail = bytearray(50), bytearray(5 * MB), bytearray(4 * MB + 73 + 10)  # 10 bytes to spare
    assert c.get_into(path, [head, memoryview(mid), tail]) == len(data)
    assert bytes(head) + bytes(mid) + bytes(tail[:4 * MB + 73]) == data
    assert c.get_into(path, (bytearray(123), bytearray(len(data) - 123))) == len(data)  # a tuple, exactly full
    with pytest.raises(ValueError):
        c.get_into(path, [bytearray(10), bytearray(len(data) - 11)])  # one byte short: an error, nothing stored lost
    assert c.get(path) == data
    # a flipped byte on the worker's disk in the middle buffer's part: the CRC over the scattered parts catches it
    block = next(f for w in cluster.workers for f in w.data_dir.rglob("*")
                 if f.is_file() and f.stat().st_size == len(data) and f.read_bytes() == data)
    b = bytearray(block.read_bytes())
    b[3 * MB] ^= 0xFF
    block.write_bytes(bytes(b))
    c2 = cluster.client(node_id=node, short_circuit=short_circuit, data_plane=data_plane, fd_passing=fd_passing)
    try:
        assert c2.get_into(path, [bytearray(50), bytearray(5 * MB), bytearray(5 * MB)]) is None
    finally:
        c2.close()
        c.close()


def test_local_first_placement(cluster: LocalCluster) -> None:
    for w in cluster.workers:
        c = cluster.client(node_id=w.node_id)
        path = f"/place/{w.node_id}"
        assert c.put(path, b"x" * 1000)
        info = c.stat(path)
        assert info is not None and info.nodes == [w.node_id]


def test_put_if_absent_and_overwrite(cluster: LocalCluster) -> None:
    c = cluster.client(node_id="node-2")
    assert c.put("/pia/a", b"first") is True
    assert c.put("/pia/a", b"second") is False  # no-op, first version kept
    assert c.get("/pia/a") == b"first"
    assert c.put("/pia/a", b"third", if_absent=False) is True
    assert c.get("/pia/a") == b"third"


def test_misses_are_none(cluster: LocalCluster) -> None:
    c = cluster.client(node_id="node-1")
    assert c.get("/nope/x") is None
    assert c.get_into("/nope/x", bytearray(10)) is None
    assert c.stat("/nope/x") is None and not c.exists("/nope/x")
    c.mkdir("/adir")
    assert c.get("/adir") is None  # a directory is not a readable file


def test_metadata_ops(cluster: LocalCluster) -> None:
    c = cluster.client(node_id="node-1")
    c.mkdir("/m/sub/deep", parents=True)
    with pytest.raises(AlreadyExists):
        c.mkdir("/m/sub", exist_ok=False)
    with pytest.raises(NotFound):
        c.mkdir("/missing/parent/x", parents=False)
    c.put("/m/sub/f1", b"1")
    c.put("/m/f2", b"22")
    names = {(i.path, i.is_dir, i.size) for i in c.ls("/m")}
    assert names == {("/m/sub", True, 0), ("/m/f2", False, 2)}
    assert [i.path for i in c.ls("/m/f2")] == ["/m/f2"]
    with pytest.raises(NotFound):
        c.ls("/m/none")
    # walk: every file under a directory, nested ones too, by absolute path; an absent root has none
    c.put("/m/sub/deeper/f3", b"333")
    assert {p: i.size for p, i in c.walk("/m").items()} == {"/m/sub/f1": 1, "/m/f2": 2, "/m/sub/deeper/f3": 3}
    assert c.walk("/m/none") == {}
    assert c.walk("/m/f2").keys() == {"/m/f2"}
    c.rm("/m/sub/deeper/f3")
    c.rmdir("/m/sub/deeper")
    with pytest.raises(L2fsError):
        c.rmdir("/m/sub")  # not empty
    # rename: atomic over an existing file
    c.put("/m/dst", b"old")
    c.rename("/m/f2", "/m/dst")
    assert c.get("/m/dst") == b"22" and c.get("/m/f2") is None
    c.put("/m/f3", b"333")
    with pytest.raises(AlreadyExists):
        c.rename("/m/f3", "/m/dst", overwrite=False)
    with pytest.raises(NotFound):
        c.rename("/m/zzz", "/m/yyy")
    # directory rename moves the subtree
    c.rename("/m/sub", "/m/moved")
    assert c.get("/m/moved/f1") == b"1" and c.stat("/m/sub") is None
    assert c.stat("/m/moved/deep").is_dir
    # rm / rmdir
    assert c.rm("/m/moved/f1") is True and c.rm("/m/moved/f1") is False
    c.rmdir("/m/moved/deep")
    assert c.rm("/m/moved") is True  # empty dir
    with pytest.raises(L2fsError):
        c.put("/m/dst/child", b"x")  # parent is a file


def test_batch_calls(cluster: LocalCluster) -> None:
    c = cluster.client(node_id="node-2")
    paths = [f"/batch/chunk{i}" for i in range(8)]
    items = [(p, os.urandom(1000 + i)) for i, p in enumerate(paths)]
    assert c.put_many(items[:5], order_hints=list(range(5))) == [True] * 5
    assert c.prefix_lookup(paths) == 5
    assert c.prefix_lookup(paths[1:3]) == 2
    assert c.prefix_lookup(["/batch/none", *paths]) == 0
    assert c.prefix_lookup([]) == 0
    stats = c.stat_many(paths)
    assert [s is not None for s in stats] == [True] * 5 + [False] * 3
    assert [s.size for s in stats[:5]] == [1000 + i for i in range(5)]
    got = c.get_many(paths)
    assert got[:5] == [d for _, d in items[:5]] and got[5:] == [None] * 3


def test_invalid_paths_client_side(cluster: LocalCluster) -> None:
    c = cluster.client()
    for bad in ["relative", "/a/../b", "/a//b", "/a/\x00b", "", "/" + "x" * 300, "/./a"]:
        with pytest.raises(InvalidPath):
            c.put(bad, b"x")
        with pytest.raises(InvalidPath):
            c.stat(bad)


def test_report(cluster: LocalCluster) -> None:
    rep = cluster.client().report()
    assert len(rep.workers) == 2 and all(w.alive for w in rep.workers)
    assert rep.capacity == 2 * (1 << 30)
    assert {w.node_id for w in rep.workers} == {"node-1", "node-2"}


async def test_async_client(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.master, node_id="node-1") as ac:
        data = os.urandom(100_000)
        results = await asyncio.gather(*(ac.put(f"/async/{i}", data) for i in range(4)))
        assert results == [True] * 4
        assert await ac.get("/async/3") == data
        assert await ac.prefix_lookup([f"/async/{i}" for i in range(6)]) == 4
        assert await ac.get("/async/none") is None
        assert (await ac.stat("/async/0")).size == len(data)


def test_duplicate_content_detector(make_cluster: Callable[..., LocalCluster]) -> None:
    cl = make_cluster(1, capacity="256M")
    c = cl.client(node_id="node-1")
    chunk = os.urandom(64 * 1024)
    c.put("/kv/seed-a/chunk0", chunk)
    c.put("/kv/other", os.urandom(64 * 1024))
    c.put("/kv/small-a", b"tiny")
    c.put("/kv/small-b", b"tiny")  # small files are ignored
    assert c.report().duplicate_files == 0
    c.put("/kv/seed-b/chunk0", chunk)  # same KV bytes under a different key
    c.put("/kv/seed-c/chunk0", chunk)
    assert c.report().duplicate_files == 2
    c.rm("/kv/seed-c/chunk0")
    c.rename("/kv/seed-b/chunk0", "/kv/seed-b/renamed")
    assert c.report().duplicate_files == 1
    c.rm("/kv/seed-a/chunk0")
    assert c.report().duplicate_files == 0


def test_namespace_errors_carry_errno(cluster: LocalCluster) -> None:
    """The master names an errno for namespace conflicts (trailing metadata), so the FUSE mount and other
    callers map errors without parsing message text."""
    import errno

    c = cluster.client(node_id="node-1")
    c.put("/errno/dir/f", b"x")
    c.put("/errno/file", b"y")
    cases = [
        (lambda: c.rmdir("/errno/dir"), errno.ENOTEMPTY),
        (lambda: c.mkdir("/errno/file/sub"), errno.ENOTDIR),
        (lambda: c.put("/errno/dir", b"z", if_absent=False), errno.EISDIR),
        (lambda: c.rename("/errno/file", "/errno/dir"), errno.EISDIR),
        (lambda: c.rename("/errno/dir", "/errno/dir/inner"), errno.EINVAL),
    ]
    for call, want in cases:
        with pytest.raises(L2fsError) as ei:
            call()
        assert getattr(ei.value, "errno", None) == want, (ei.value, want)
    assert c.get("/errno/dir/f") == b"x" and c.get("/errno/file") == b"y"  # nothing lost
