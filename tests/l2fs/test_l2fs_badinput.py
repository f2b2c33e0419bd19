"""Bad input gets a clear gRPC status and message; nothing crashes and nothing stored is lost."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from l2fs_helpers import wait_until

from l2fs.client import InvalidArgument, InvalidPath
from l2fs.common import BlockKey
from l2fs.common.capability import mint_for, seal_mac
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.testing.cluster import LocalCluster

BAD_PATHS = ["relative/x", "/a/../../etc/passwd", "/a//b", "/nul\x00x", "", "/" + "n" * 256,
             "/" + "/".join(["d"] * 3000), "/a/./b", "/ctl\nx"]


@pytest.fixture(scope="module")
def bcluster(cluster_factory: Callable[..., LocalCluster]) -> LocalCluster:
    c = cluster_factory(1, name="bad", capacity="256M", heartbeat_timeout=2, heartbeat_interval=0.3,
                        master_args=["--max-file-size", "8M"], worker_args=["--max-file-size", "8M"])
    c.client(node_id="node-1").put("/keep/me", b"precious")
    return c


def _status(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value


def _master(c: LocalCluster) -> pbg.MasterStub:
    return pbg.MasterStub(grpc.insecure_channel(c.master))


def _worker(c: LocalCluster) -> pbg.WorkerStub:
    return pbg.WorkerStub(grpc.insecure_channel(c.workers[0].address))


def _cap(c: LocalCluster, op: str, bid: str, path: str = "", size: int | None = None) -> str:
    """The block capability the master would hand a client for worker 1 (the worker wants one, not a token); a
    write's binds the size it was allocated for."""
    assert c.block_key_file is not None
    return mint_for(c.block_key_file.read_bytes(), c.workers[0].worker_id, op, bid, path, size=size)


def _intact(c: LocalCluster) -> None:
    assert c.client(node_id="x").get("/keep/me") == b"precious"


@pytest.mark.parametrize("bad", BAD_PATHS, ids=range(len(BAD_PATHS)))
def test_bad_paths_rejected_by_servers(bcluster: LocalCluster, bad: str) -> None:
    m, w = _master(bcluster), _worker(bcluster)
    calls = [
        lambda: m.Stat(pb.PathRequest(path=bad), timeout=5),
        lambda: m.Allocate(pb.AllocateRequest(path=bad, size=1), timeout=5),
        lambda: m.StatMany(pb.PathsRequest(paths=["/ok", bad]), timeout=5),
        lambda: m.PrefixLookup(pb.PathsRequest(paths=["/keep/me", bad]), timeout=5),
        lambda: m.Rename(pb.RenameRequest(src="/keep/me", dst=bad), timeout=5),
        lambda: m.Mkdir(pb.MkdirRequest(path=bad, parents=True), timeout=5),
        lambda: m.Commit(pb.CommitRequest(path=bad, block_id="0" * 32, worker_id="w"), timeout=5),
        lambda: w.WriteBlock(iter([pb.WriteChunk(block_id="1" * 32, path=bad, size=1, data=b"x")]), timeout=5),
    ]
    for call in calls:
        e = _status(call)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "path" in e.details()
    with pytest.raises(InvalidPath):
        bcluster.client().put(bad, b"x")
    _intact(bcluster)


def test_oversize_file(bcluster: LocalCluster) -> None:
    c = bcluster.client(node_id="node-1")
    with pytest.raises(InvalidArgument, match="max file size"):
        c.put("/big/one", b"x" * (9 << 20))
    e = _status(lambda: _worker(bcluster).ReserveLocal(pb.ReserveRequest(
        block_id="2" * 32, size=9 << 20, capability=_cap(bcluster, "w", "2" * 32, size=9 << 20)), timeout=5))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "max file size" in e.details()
    assert c.put("/big/ok", b"x" * (8 << 20)) is True
    _intact(bcluster)


def test_unknown_and_malformed_block_ids(bcluster: LocalCluster) -> None:
    w = _worker(bcluster)
    e = _status(lambda: list(w.ReadBlock(pb.ReadRequest(block_id="f" * 32, capability=_cap(bcluster, "r", "f" * 32)),
                                         timeout=5)))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "not found" in e.details()
    for bad in ["../../etc/passwd", "", "X" * 32, "a" * 33]:
        e = _status(lambda b=bad: list(w.ReadBlock(pb.ReadRequest(block_id=b), timeout=5)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "block id" in e.details()
        e = _status(lambda b=bad: w.DeleteBlocks(pb.BlockIds(block_ids=[b]), timeout=5))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    e = _status(lambda: w.AdoptLocal(pb.AdoptRequest(block_id="3" * 32, path="/x", size=1,
                                                     capability=_cap(bcluster, "w", "3" * 32, "/x", 1)), timeout=5))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "not reserved" in e.details()
    e = _status(lambda: _master(bcluster).Commit(pb.CommitRequest(path="/x/y", block_id="4" * 32,
                                                                  worker_id="no-such-worker"), timeout=5))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "not alive" in e.details()
    _intact(bcluster)


def test_write_stream_size_mismatch(bcluster: LocalCluster) -> None:
    w = _worker(bcluster)
    caps = {(b, n): _cap(bcluster, "w", b * 32, "/s/a", n) for b, n in (("5", 4), ("6", 100), ("5", 2))}
    e = _status(lambda: w.WriteBlock(iter([pb.WriteChunk(block_id="5" * 32, path="/s/a", size=4,
                                                         data=b"too long", capability=caps["5", 4])]), timeout=5))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than the declared" in e.details()
    e = _status(lambda: w.WriteBlock(iter([pb.WriteChunk(block_id="6" * 32, path="/s/a", size=100,
                                                         data=b"short", capability=caps["6", 100])]), timeout=5))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "ended after" in e.details()
    e = _status(lambda: w.WriteBlock(iter([]), timeout=5))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the failed writes left nothing behind: their ids are free again
    r = w.WriteBlock(iter([pb.WriteChunk(block_id="5" * 32, path="/s/a", size=2, data=b"ok",
                                         capability=caps["5", 2])]), timeout=5)
    assert r.size == 2
    _intact(bcluster)


def test_malformed_messages(bcluster: LocalCluster) -> None:
    ch = grpc.insecure_channel(bcluster.master)
    for method in ["/l2fs.Master/Stat", "/l2fs.Master/RegisterWorker", "/l2fs.Master/Rename"]:
        raw = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        e = _status(lambda r=raw: r(b"\xff\xfe\x00garbage" * 10, timeout=5))
        assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), e
    e = _status(lambda: ch.unary_unary("/l2fs.Master/NoSuchMethod")(b"", timeout=5))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED
    _intact(bcluster)


def test_double_registration_replaces_cleanly(bcluster: LocalCluster) -> None:
    m = _master(bcluster)
    assert bcluster.block_key_file is not None
    key = BlockKey(bcluster.block_key_file.read_bytes())  # ids as the master would have minted them

    def report(path: str) -> pb.BlockReport:  # a committed block: its id minted and sealed (protocol 4)
        bid = key.mint("dup", 3)
        return pb.BlockReport(block_id=bid, path=path, size=3, mtime=1.0, seal=seal_mac(key.key, "dup", bid, 3, 0, path))

    def register(paths: list[str]) -> None:
        m.RegisterWorker(pb.RegisterRequest(
            worker_id="dup", node_id="ghost", address="127.0.0.1:1", capacity=1 << 30,
            blocks=[report(p) for p in paths]), timeout=5)

    register(["/dup/a", "/dup/b"])
    c = bcluster.client()
    assert {i.path for i in c.ls("/dup")} == {"/dup/a", "/dup/b"}
    register(["/dup/c"])
    assert {i.path for i in c.ls("/dup")} == {"/dup/c"}
    assert sum(w.worker_id == "dup" for w in c.report().workers) == 1
    assert c.get("/dup/c") is None  # its address is dead: a miss, not an error
    # a register that claims an existing path with an older copy does not steal it
    m.RegisterWorker(pb.RegisterRequest(worker_id="dup2", node_id="ghost", address="127.0.0.1:1",
                                        capacity=1 << 30, blocks=[pb.BlockReport(
                                            block_id="e" * 32, path="/keep/me", size=3, mtime=1.0)]),
                     timeout=5)
    _intact(bcluster)
    wait_until(lambda: c.stat("/dup/c") is None, timeout=5)  # never heartbeats: dropped as dead
    e = _status(lambda: m.RegisterWorker(pb.RegisterRequest(worker_id="", address=""), timeout=5))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
