"""Unit tier: both worker transports in process over one Store — the raw-TCP data plane (DataServer and
DataClient) and the gRPC WorkerService — on loopback ports of the test: they write through the same
receive path and open blocks through the same damage check, so they must answer alike."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
import grpc
import pytest

from l2fs.common import grpc_server, make_channel
from l2fs.dataplane import DataClient, DataPlaneBusy, DataPlaneError
from l2fs.dataplane.server import DataServer
from l2fs.dataplane.wire import BAD, DENIED, NOT_FOUND
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.worker.service import WorkerService
from l2fs.worker.store import Store

pytestmark = pytest.mark.unit
KB = 1024
TOKEN = "s3cret"


@dataclass
class Worker:
    store: Store
    data: DataClient
    data_address: str
    stub: pbg.WorkerStub
    reports: list[int]  # one entry per "report now" wake-up the servers asked for

    def deadline(self) -> float:
        return time.monotonic() + 10


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    store = Store([(tmp_path / "d", 1 << 20)], max_file_size=256 * KB, max_reserved=0.25)
    reports: list[int] = []
    dserver = DataServer(store, "127.0.0.1", 0, TOKEN, lambda: reports.append(1))
    dserver.start()
    gserver, gport, _ = grpc_server("127.0.0.1", 0, lambda s: pbg.add_WorkerServicer_to_server(
        WorkerService(store, lambda: reports.append(1)), s), name="test-worker")
    gserver.start()
    client = DataClient(TOKEN)
    try:
        yield Worker(store, client, f"127.0.0.1:{dserver.port}", pbg.WorkerStub(make_channel(
            f"127.0.0.1:{gport}", None)), reports)
    finally:
        client.close()
        dserver.stop()
        gserver.stop(0)


def grpc_write(w: Worker, bid: str, data: bytes, size: int | None = None) -> pb.WriteResult:
    frames = [pb.WriteChunk(block_id=bid, path=f"/g/{bid}", size=len(data) if size is None else size,
                            data=data[:1000])] + [pb.WriteChunk(data=data[i:i + 1000])
                                                  for i in range(1000, len(data), 1000)]
    return w.stub.WriteBlock(iter(frames), timeout=10)


def grpc_read(w: Worker, bid: str) -> bytes:
    return b"".join(c.data for c in w.stub.ReadBlock(pb.ReadRequest(block_id=bid), timeout=10))


def test_write_on_one_transport_read_on_the_other(worker: Worker) -> None:
    data = os.urandom(100 * KB)
    a = uuid.uuid4().hex
    crc, local = worker.data.write(worker.data_address, a, f"/t/{a}", memoryview(data), 3, worker.deadline())
    assert crc == crc32c.crc32c(data) and Path(local).read_bytes() == data
    assert grpc_read(worker, a) == data
    b = uuid.uuid4().hex
    res = grpc_write(worker, b, data)
    assert res.crc32c == crc and worker.store.blocks[b].path == f"/g/{b}"
    got, crc_b, _ = worker.data.read(worker.data_address, b, worker.deadline())
    assert got == data and crc_b == crc
    buf = bytearray(len(data))
    n, _, computed = worker.data.read(worker.data_address, a, worker.deadline(), memoryview(buf))
    assert n == len(data) and bytes(buf) == data and computed == crc
    empty = uuid.uuid4().hex
    worker.data.write(worker.data_address, empty, "/t/empty", memoryview(b""), 0, worker.deadline())
    assert worker.data.read(worker.data_address, empty, worker.deadline())[0] == b""


def test_refusals_have_typed_statuses(worker: Worker) -> None:
    d = worker.deadline()
    with pytest.raises(DataPlaneError) as e:  # over the max file size: the caller's argument
        worker.data.write(worker.data_address, uuid.uuid4().hex, "/x", memoryview(bytes(300 * KB)), 0, d)
    assert e.value.status == BAD
    with pytest.raises(DataPlaneError) as e:
        worker.data.read(worker.data_address, "0" * 32, d)
    assert e.value.status == NOT_FOUND
    with pytest.raises(DataPlaneError) as e:  # a malformed id (it would become a file name)
        worker.data.read(worker.data_address, "../../etc/passwd" + "x" * 16, d)
    assert e.value.status == BAD
    with pytest.raises(DataPlaneError) as e:
        DataClient("wrong").read(worker.data_address, "0" * 32, d)
    assert e.value.status == DENIED
    with pytest.raises(grpc.RpcError) as g:
        grpc_write(worker, uuid.uuid4().hex, bytes(300 * KB))
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_busy_when_too_many_bytes_are_promised(worker: Worker) -> None:
    worker.store.reserve(uuid.uuid4().hex, 256 * KB)  # 25 % of the dir: the next write must wait
    with pytest.raises(DataPlaneBusy):
        worker.data.write(worker.data_address, uuid.uuid4().hex, "/x", memoryview(bytes(KB)), 0, worker.deadline())
    with pytest.raises(grpc.RpcError) as g:
        grpc_write(worker, uuid.uuid4().hex, bytes(KB))
    assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_short_grpc_stream_is_refused_and_released(worker: Worker) -> None:
    with pytest.raises(grpc.RpcError) as g:
        grpc_write(worker, uuid.uuid4().hex, bytes(5 * KB), size=6 * KB)
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not worker.store.reservations and worker.store.used == 0


@pytest.mark.parametrize("via", ["tcp", "grpc"])
def test_damaged_block_is_a_miss_and_dropped(worker: Worker, via: str) -> None:
    bid = uuid.uuid4().hex
    grpc_write(worker, bid, os.urandom(10 * KB))
    os.truncate(worker.store.local_path(worker.store.blocks[bid]), 10)
    before = len(worker.reports)
    if via == "tcp":
        with pytest.raises(DataPlaneError) as e:
            worker.data.read(worker.data_address, bid, worker.deadline())
        assert e.value.status == NOT_FOUND
    else:
        with pytest.raises(grpc.RpcError) as g:
            grpc_read(worker, bid)
        assert g.value.code() == grpc.StatusCode.NOT_FOUND
    assert bid not in worker.store.blocks and worker.store.removed == [(bid, "corrupt")]
    assert len(worker.reports) > before  # the master hears of it now, not at the next heartbeat


def test_report_corrupt_rechecks_before_dropping(worker: Worker) -> None:
    good, bad = uuid.uuid4().hex, uuid.uuid4().hex
    grpc_write(worker, good, os.urandom(5 * KB))
    grpc_write(worker, bad, os.urandom(5 * KB))
    f = Path(worker.store.local_path(worker.store.blocks[bad]))
    raw = bytearray(f.read_bytes())
    raw[0] ^= 1
    f.write_bytes(bytes(raw))
    worker.stub.ReportCorrupt(pb.BlockIds(block_ids=[good, bad]), timeout=10)
    assert good in worker.store.blocks and bad not in worker.store.blocks


def test_read_to_file_splices_the_block_into_the_file(worker: Worker, tmp_path: Path) -> None:
    """The passthrough mount's cross-node fetch: the block lands in the file byte for byte with the recorded
    CRC, the connection goes back to the pool and serves the next read; a missing block is the typed miss."""
    data = os.urandom(200 * KB + 7)
    bid = uuid.uuid4().hex
    worker.data.write(worker.data_address, bid, f"/s/{bid}", memoryview(data), 0, worker.deadline())
    fd = os.open(tmp_path, os.O_TMPFILE | os.O_RDWR)
    try:
        assert worker.data.read_to_file(worker.data_address, bid, worker.deadline(), fd) == (
            len(data), crc32c.crc32c(data))
        assert os.pread(fd, len(data) + 1, 0) == data
        assert worker.data.read(worker.data_address, bid, worker.deadline())[0] == data  # same pooled socket
        with pytest.raises(DataPlaneError) as e:
            worker.data.read_to_file(worker.data_address, uuid.uuid4().hex, worker.deadline(), fd)
        assert e.value.status == NOT_FOUND
    finally:
        os.close(fd)


@pytest.mark.parametrize("peer", ["stalls", "closes"])
def test_splice_in_ends_on_a_stalled_or_closed_peer(tmp_path: Path, peer: str) -> None:
    """A peer that sends half a block and then stalls ends the splice at the socket's timeout (a miss for the
    mount, not a hang); one that closes mid-block ends it at once."""
    import socket

    from l2fs.dataplane.client import splice_in

    ls = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(ls.getsockname())
    s, _ = ls.accept()
    fd = os.open(tmp_path, os.O_TMPFILE | os.O_RDWR)
    try:
        deadline = time.monotonic() + 0.5
        DataClient._arm(c, deadline)
        s.sendall(os.urandom(64 * KB))
        if peer == "closes":
            s.close()
        t0 = time.monotonic()
        with pytest.raises(ConnectionError if peer == "closes" else BlockingIOError):  # EAGAIN: SO_RCVTIMEO
            splice_in(c, fd, 128 * KB, deadline + 10)  # the socket's own timeout (0.5 s) ends it
        assert time.monotonic() - t0 < 5
    finally:
        os.close(fd)
        for x in (c, s, ls):
            x.close()


def test_splice_into_a_file_that_cannot_take_it_says_so(tmp_path: Path) -> None:
    """A destination without splice support (an eventfd here; a cache dir on such a file system in a mount) is
    SpliceUnsupported, an OSError the passthrough mount answers by reading through a buffer instead, not a fault
    of the worker."""
    import socket

    from l2fs.dataplane.client import SpliceUnsupported, splice_in

    ls = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(ls.getsockname())
    s, _ = ls.accept()
    efd = os.eventfd(0)
    try:
        s.sendall(os.urandom(4 * KB))
        DataClient._arm(c, time.monotonic() + 5)
        with pytest.raises(SpliceUnsupported):
            splice_in(c, efd, 4 * KB, time.monotonic() + 5)
    finally:
        os.close(efd)
        for x in (c, s, ls):
            x.close()
