"""Unit tier: the master's namespace, registry and placement (MasterService) in process, served on an
ephemeral loopback port, with an in-process worker service (real Store on tmp_path) for the calls the
master makes to workers. The test plays the worker's registration and the client's steps itself."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from polling import wait_until

from l2fs.common import grpc_server, make_channel
from l2fs.master import MasterService, serve
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.worker.service import WorkerService
from l2fs.worker.store import Store

pytestmark = pytest.mark.unit
GB = 1 << 30


@dataclass
class Setup:
    service: MasterService
    master: pbg.MasterStub
    store: Store
    worker_address: str


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    service = MasterService(heartbeat_timeout=30.0, max_file_size=2 * GB)
    server, port = serve("127.0.0.1", 0, service)
    store = Store([(tmp_path / "w1", 1 << 20)])
    wserver, wport, _ = grpc_server("127.0.0.1", 0, lambda s: pbg.add_WorkerServicer_to_server(
        WorkerService(store, lambda: None), s), name="test-worker")
    wserver.start()
    try:
        yield Setup(service, pbg.MasterStub(make_channel(f"127.0.0.1:{port}", None)), store, f"127.0.0.1:{wport}")
    finally:
        service.close()
        server.stop(0)
        wserver.stop(0)


def register(s: Setup, worker_id: str = "w1", node: str = "n1", *, address: str | None = None,
             capacity: int = GB, used: int = 0, blocks: list[pb.BlockReport] | None = None) -> list[str]:
    resp = s.master.RegisterWorker(pb.RegisterRequest(
        worker_id=worker_id, node_id=node, address=address or s.worker_address, capacity=capacity, used=used,
        blocks=blocks or []))
    return list(resp.delete_blocks)


def put(s: Setup, path: str, data: bytes, *, node: str = "n1", if_absent: bool = False) -> bool:
    """What the client does: Allocate, write the block to the chosen worker (here: the store), Commit."""
    alloc = s.master.Allocate(pb.AllocateRequest(path=path, size=len(data), node_id=node, if_absent=if_absent))
    if alloc.exists:
        return False
    b = s.store.receive(alloc.block_id, path, len(data), 0, [data])
    return s.master.Commit(pb.CommitRequest(
        path=path, block_id=alloc.block_id, worker_id=alloc.worker.worker_id, size=b.size, crc32c=b.crc32c,
        local_path=s.store.local_path(b), if_absent=if_absent)).published


def rpc_error(call: object, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(request)  # type: ignore[operator]
    return e.value


def trailer(e: grpc.RpcError, key: str) -> str | None:
    return dict(e.trailing_metadata() or ()).get(key)  # type: ignore[attr-defined]


def test_put_stat_list_and_if_absent(setup: Setup) -> None:
    register(setup)
    assert put(setup, "/kv/a/1", b"one")
    st = setup.master.Stat(pb.PathRequest(path="/kv/a/1"))
    assert st.exists and st.size == 3 and [loc.worker_id for loc in st.locations] == ["w1"]
    assert not put(setup, "/kv/a/1", b"two", if_absent=True)
    assert [e.path for e in setup.master.List(pb.PathRequest(path="/kv")).entries] == ["/kv/a"]
    assert setup.master.PrefixLookup(pb.PathsRequest(paths=["/kv/a/1", "/kv/a/2", "/kv/a/1"])).count == 1
    assert setup.master.Report(pb.Empty()).files == 1


def test_overwrite_deletes_the_old_block_on_its_worker(setup: Setup) -> None:
    register(setup)
    put(setup, "/f", b"old")
    old = setup.master.Stat(pb.PathRequest(path="/f")).locations[0].block_id
    put(setup, "/f", b"new!")
    wait_until(lambda: old not in setup.store.blocks, 10, 0.01)  # told in the background
    assert setup.master.Stat(pb.PathRequest(path="/f")).size == 4


def test_placement_local_first_then_most_free(setup: Setup) -> None:
    register(setup, "w1", "n1", used=int(GB * 0.9) - 1000)  # 1000 bytes under its high watermark
    register(setup, "w2", "n2", used=0)
    register(setup, "w3", "n3", used=GB // 2)
    place = lambda size, node, exclude=(): setup.master.Allocate(pb.AllocateRequest(  # noqa: E731
        path="/p", size=size, node_id=node, exclude_workers=list(exclude))).worker.worker_id
    assert place(10, "n1") == "w1"  # local and room left
    assert place(2000, "n1") == "w2"  # no room left locally: the most free
    assert place(1000, "n9", ["w2"]) == "w3"
    e = rpc_error(setup.master.Allocate, pb.AllocateRequest(path="/p", size=GB + 1))  # larger than any worker
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and trailer(e, "l2fs-errno") == "ENOSPC"


def test_reregistration_abandons_uncommitted_allocations(setup: Setup) -> None:
    register(setup)
    alloc = setup.master.Allocate(pb.AllocateRequest(path="/late", size=3))
    b = setup.store.receive(alloc.block_id, "/late", 3, 0, [b"abc"])
    # the worker restarts before the commit and reports the sealed block: it must not be published
    reject = register(setup, blocks=[pb.BlockReport(block_id=b.block_id, path="/late", size=3, crc32c=b.crc32c)])
    assert reject == [b.block_id]
    e = rpc_error(setup.master.Commit, pb.CommitRequest(path="/late", block_id=b.block_id, worker_id="w1", size=3))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not setup.master.Stat(pb.PathRequest(path="/late")).exists


def test_registration_rebuilds_the_namespace(setup: Setup) -> None:
    ids = [uuid.uuid4().hex for _ in range(4)]
    rep = lambda i, path, mtime: pb.BlockReport(block_id=ids[i], path=path, size=1, mtime=mtime)  # noqa: E731
    register(setup, "w2", "n2", address="127.0.0.1:1")
    setup.master.Mkdir(pb.MkdirRequest(path="/dir/sub", parents=True))
    reject = register(setup, blocks=[rep(0, "/x/y", 5.0), rep(1, "/dir/sub", 5.0), rep(2, "../bad", 5.0),
                                     pb.BlockReport(block_id="not-a-block-id", path="/z", size=1)])
    assert sorted(reject) == sorted([ids[1], ids[2]])  # a path that is a directory; an invalid path
    assert setup.master.Stat(pb.PathRequest(path="/x/y")).locations[0].block_id == ids[0]
    assert not setup.master.Stat(pb.PathRequest(path="/z")).exists
    assert register(setup, "w2", "n2", address="127.0.0.1:1", blocks=[rep(3, "/x/y", 1.0)]) == [ids[3]]  # older
    e = rpc_error(setup.master.RegisterWorker, pb.RegisterRequest(worker_id="bad id", address="h:1"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_removals_count_only_from_the_holding_worker(setup: Setup) -> None:
    register(setup)
    register(setup, "w2", "n2", address="127.0.0.1:1")
    put(setup, "/r", b"x")
    bid = setup.master.Stat(pb.PathRequest(path="/r")).locations[0].block_id
    setup.master.RemoveBlocks(pb.BlocksRemoved(worker_id="w2", block_ids=[bid], reason="evicted"))
    assert setup.master.Stat(pb.PathRequest(path="/r")).exists
    setup.master.MoveBlocks(pb.BlocksMoved(worker_id="w1", block_ids=[bid], local_paths=["/elsewhere"]))
    assert setup.master.Stat(pb.PathRequest(path="/r")).locations[0].local_path == "/elsewhere"
    setup.master.RemoveBlocks(pb.BlocksRemoved(worker_id="w1", block_ids=[bid], reason="evicted"))
    assert not setup.master.Stat(pb.PathRequest(path="/r")).exists


def test_heartbeat_of_unknown_worker_asks_to_reregister(setup: Setup) -> None:
    assert setup.master.Heartbeat(pb.HeartbeatRequest(worker_id="ghost")).reregister
    register(setup)
    assert not setup.master.Heartbeat(pb.HeartbeatRequest(worker_id="w1", capacity=GB)).reregister


def test_rename_directory_moves_files_and_tells_the_worker(setup: Setup) -> None:
    register(setup)
    put(setup, "/a/b/f1", b"1")
    put(setup, "/a/f2", b"2")
    setup.master.Rename(pb.RenameRequest(src="/a", dst="/c/d"))
    assert not setup.master.Stat(pb.PathRequest(path="/a/b/f1")).exists
    st = setup.master.Stat(pb.PathRequest(path="/c/d/b/f1"))
    assert st.exists and setup.store.blocks[st.locations[0].block_id].path == "/c/d/b/f1"  # SetPaths reached it
    e = rpc_error(setup.master.Rename, pb.RenameRequest(src="/c", dst="/c/d/e"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and trailer(e, "l2fs-errno") == "EINVAL"


def test_a_push_confirmed_across_a_reregistration_stays_pending(setup: Setup) -> None:
    """The race a CI run caught (tests/reliability/test_reliability_durable_ns.py): a rename pushed to a worker
    that was paused, declared dead while the push was in flight, then woke, applied it and answered; its
    re-registration report, read before it applied the rename, still says the old path. The master must not
    forget the change on that answer, or the report publishes the renamed-away path again."""
    register(setup)
    put(setup, "/ns/a", b"payload")
    bid = setup.master.Stat(pb.PathRequest(path="/ns/a")).locations[0].block_id
    stale = pb.BlockReport(block_id=bid, path="/ns/a", size=7, mtime=setup.store.blocks[bid].mtime,
                           crc32c=setup.store.blocks[bid].crc32c)
    real = setup.service._worker_stub(setup.worker_address)

    class DiesDuringThePush:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def SetPaths(self, request: pb.SetPathsRequest, **kw: object) -> object:  # noqa: N802
            with setup.service.lock:  # what the reaper does when the heartbeat is overdue
                setup.service.workers["w1"].alive = False
            return real.SetPaths(request, **kw)  # then the worker wakes, applies it and answers

    setup.service._stubs[setup.worker_address] = DiesDuringThePush()
    setup.master.Rename(pb.RenameRequest(src="/ns/a", dst="/ns/b"))
    assert setup.store.blocks[bid].path == "/ns/b"  # the worker applied it
    setup.service._stubs[setup.worker_address] = real
    register(setup, blocks=[stale])  # the report it read before applying the rename
    assert not setup.master.Stat(pb.PathRequest(path="/ns/a")).exists, "the renamed-away path came back"
    assert setup.master.Stat(pb.PathRequest(path="/ns/b")).locations[0].block_id == bid
    wait_until(lambda: len(setup.service.pending) == 0, 10)  # and the next push confirms it for good


def test_errors_carry_structured_kinds(setup: Setup) -> None:
    register(setup)
    put(setup, "/dir/f", b"x")
    e = rpc_error(setup.master.Rmdir, pb.PathRequest(path="/dir"))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and trailer(e, "l2fs-errno") == "ENOTEMPTY"
    e = rpc_error(setup.master.Stat, pb.PathRequest(path="/a/../b"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and trailer(e, "l2fs-error") == "path"
    e = rpc_error(setup.master.Allocate, pb.AllocateRequest(path="/big", size=3 * GB))  # not a path problem
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and trailer(e, "l2fs-error") is None
    e = rpc_error(setup.master.Commit, pb.CommitRequest(path="/c", block_id="../../etc", worker_id="w1"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    e = rpc_error(setup.master.Allocate, pb.AllocateRequest(path="/dir", size=1))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and trailer(e, "l2fs-errno") == "EISDIR"
