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
