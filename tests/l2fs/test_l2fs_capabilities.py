"""Per-block capabilities on the data plane (HDFS block tokens are the model).

Before, the worker's raw-TCP data plane and fd socket took any known token for any block id: an engine
token read every block by id. Now a master with a block key hands each worker its data key at registration
and each client a capability per block and op; the worker takes nothing else there. These tests run a real
master and workers with a tokens file and talk to the workers as an engine-token holder would: with its
token, with capabilities of other blocks, ops, paths or workers, expired ones, and the real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from l2fs_helpers import wait_until

from l2fs.common import capability, make_channel
from l2fs.common.capability import DataGate, Minter, data_key, expiry_of, mint, mint_for, parse, why_denied
from l2fs.common.fdpass import READ as FD_READ
from l2fs.common.fdpass import WRITE as FD_WRITE
from l2fs.common.fdpass import FdPassError, request_fd
from l2fs.dataplane import DataClient, DataPlaneError
from l2fs.dataplane.wire import DENIED
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.testing.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
MASTER, WORKER, ENGINE, ADMIN = (f"{who}-token-0123456789" for who in ("master", "worker", "engine", "admin"))
PREFIX = "/kv/ep-a"
TTL = 4  # the master's --capability-ttl here (workers: --capability-skew 0)
TOKENS = [{"name": "master", "token": MASTER, "role": "worker"},
          {"name": "worker-node-1", "token": WORKER, "role": "worker"},
          {"name": "worker-node-2", "token": WORKER + "-b", "role": "worker"},
          {"name": "engine-a", "token": ENGINE, "role": "engine", "prefixes": [PREFIX]},
          {"name": "ops", "token": ADMIN, "role": "admin"}]
PRE_CAPABILITIES = "fb12189"  # the last commit before capabilities (protocol 2): the "old client"


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _cluster(factory: Callable[..., LocalCluster], sock_dir: Path, *, block_key: bool = True,
             workers: int = 2) -> LocalCluster:
    return factory(workers, name="caps", capacity="256M", token=ADMIN, block_key=block_key, tokens=TOKENS,
                   master_args=["--token", MASTER, "--capability-ttl", str(TTL)],
                   each_worker_args=[["--token", WORKER if i == 0 else WORKER + "-b",
                                      "--domain-socket", str(sock_dir / f"w{i}.sock"), "--capability-skew", "0"]
                                     for i in range(workers)])


@pytest.fixture(scope="module")
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="l2fs-cap-", dir="/tmp") as d:  # pytest's tmp paths: too long (sun_path)
        yield Path(d)


@pytest.fixture(scope="module")
def capcluster(sock_dir: Path, cluster_factory: Callable[..., LocalCluster]) -> LocalCluster:
    return _cluster(cluster_factory, sock_dir)


def _master(cl: LocalCluster, token: str = ENGINE) -> tuple[pbg.MasterStub, tuple[tuple[str, str], ...]]:
    return pbg.MasterStub(make_channel(cl.master.split(";")[0], None)), _md(token)


def _stat(cl: LocalCluster, path: str) -> pb.FileStat:
    stub, md = _master(cl)
    st = stub.Stat(pb.PathRequest(path=path), metadata=md, timeout=5)
    assert st.exists and st.locations, st
    return st


def _allocate(cl: LocalCluster, path: str, size: int) -> pb.AllocateResponse:
    """An allocation as the engine's client makes it (placed on node-1's worker, worker 0)."""
    stub, md = _master(cl)
    a = stub.Allocate(pb.AllocateRequest(path=path, size=size, node_id="node-1", if_absent=True), metadata=md,
                      timeout=5)
    assert a.block_id and a.worker.worker_id == cl.workers[0].worker_id, a
    return a


def _key(cl: LocalCluster) -> bytes:
    assert cl.block_key_file is not None
    return cl.block_key_file.read_bytes()


def _put_on_worker0(cl: LocalCluster, path: str, data: bytes) -> pb.Location:
    with cl.client(node_id="node-1", token=ADMIN, fd_passing=False, short_circuit=False) as c:
        assert c.put(path, data) is True
    loc = _stat(cl, path).locations[0]
    assert loc.worker_id == cl.workers[0].worker_id
    return loc


def _dp_read(loc: pb.Location, cred: str, token: str = ENGINE) -> bytes:
    """A raw data-plane read of loc's block presenting `cred` (a capability; "" = the token alone)."""
    dc = DataClient(token)
    try:
        got, _, _ = dc.read(loc.data_address, loc.block_id, time.monotonic() + 5, cap=cred)
    finally:
        dc.close()
    assert isinstance(got, bytes)
    return got


def _denied(fn: object) -> str:
    """The refusal message of a data-plane or fd call that must be DENIED."""
    with pytest.raises((DataPlaneError, FdPassError)) as e:
        fn()  # type: ignore[operator]
    assert getattr(e.value, "status", None) == DENIED, e.value
    return str(e.value)


# ---------- 1. an engine-token holder talking to the worker directly ----------

def test_data_plane_read_needs_the_blocks_read_capability(capcluster: LocalCluster) -> None:
    cl = capcluster
    data = os.urandom(30_000)
    loc = _put_on_worker0(cl, f"{PREFIX}/secret", data)
    other = _put_on_worker0(cl, f"{PREFIX}/other", b"o" * 100)
    assert loc.capability and parse(loc.capability)[:2] == ("r", loc.block_id)  # type: ignore[index]
    key, w0, w1 = _key(cl), cl.workers[0].worker_id, cl.workers[1].worker_id
    assert "upgrade the client" in _denied(lambda: _dp_read(loc, ""))  # the engine token alone
    _denied(lambda: _dp_read(loc, "", token=ADMIN))  # even admin's
    _denied(lambda: _dp_read(loc, other.capability))  # another block's read capability
    _denied(lambda: _dp_read(loc, mint_for(key, w0, "w", loc.block_id, f"{PREFIX}/secret")))  # a write one
    assert "expired" in _denied(lambda: _dp_read(loc, mint_for(key, w0, "r", loc.block_id, ttl=-2)))
    _denied(lambda: _dp_read(loc, mint_for(key, w1, "r", loc.block_id)))  # minted under worker 1's key
    _denied(lambda: _dp_read(loc, loc.capability[:-1] + ("0" if loc.capability[-1] != "0" else "1")))
    assert _dp_read(loc, loc.capability) == data  # the master's capability reads it


def test_data_plane_write_needs_the_write_capability_for_that_path(capcluster: LocalCluster) -> None:
    cl = capcluster
    path = f"{PREFIX}/w1"
    a = _allocate(cl, path, 1000)
    key, w0, w1 = _key(cl), cl.workers[0].worker_id, cl.workers[1].worker_id
    mv = memoryview(b"w" * 1000)

    def write(cred: str, to: str = path, token: str = ENGINE) -> tuple[int, str]:
        dc = DataClient(token)
        try:
            return dc.write(a.worker.data_address, a.block_id, to, mv, 0, time.monotonic() + 5, cap=cred)
        finally:
            dc.close()

    _denied(lambda: write(""))
    _denied(lambda: write("", token=ADMIN))
    _denied(lambda: write(mint_for(key, w0, "r", a.block_id)))  # a read capability
    _denied(lambda: write(a.worker.capability, to="/kv/ep-b/planted"))  # bound to the allocated path
    _denied(lambda: write(mint_for(key, w0, "w", a.block_id, path, ttl=-2)))  # expired
    _denied(lambda: write(mint_for(key, w1, "w", a.block_id, path)))  # worker 1's key
    _denied(lambda: write(_allocate(cl, f"{PREFIX}/w2", 1000).worker.capability))  # another block's
    crc, _ = write(a.worker.capability)  # the master's capability writes it
    assert crc


def test_fd_socket_needs_capabilities(capcluster: LocalCluster, sock_dir: Path) -> None:
    cl = capcluster
    sock = str(sock_dir / "w0.sock")
    data = os.urandom(20_000)
    loc = _put_on_worker0(cl, f"{PREFIX}/fd-secret", data)
    assert loc.domain_socket == sock
    key, w0, w1 = _key(cl), cl.workers[0].worker_id, cl.workers[1].worker_id
    for cred in (ENGINE, ADMIN, mint_for(key, w0, "w", loc.block_id), mint_for(key, w0, "r", loc.block_id, ttl=-2),
                 mint_for(key, w1, "r", loc.block_id), _stat(cl, f"{PREFIX}/secret").locations[0].capability):
        _denied(lambda c=cred: request_fd(sock, FD_READ, c, loc.block_id))
    fd, size, _ = request_fd(sock, FD_READ, loc.capability, loc.block_id)
    try:
        assert size == len(data) and os.pread(fd, size, 0) == data
    finally:
        os.close(fd)
    # WRITE: a reservation made with the write capability, then the temp file's fd
    path = f"{PREFIX}/fd-w"
    a = _allocate(cl, path, 500)
    stub = pbg.WorkerStub(make_channel(a.worker.address, None))
    stub.ReserveLocal(pb.ReserveRequest(block_id=a.block_id, size=500, capability=a.worker.capability, path=path),
                      metadata=_md(ENGINE), timeout=5)
    for cred, to in ((ENGINE, path), (ADMIN, path), (mint_for(key, w0, "r", a.block_id), path),
                     (a.worker.capability, "/kv/ep-b/planted"), (mint_for(key, w0, "w", a.block_id, path, ttl=-2), path),
                     (mint_for(key, w1, "w", a.block_id, path), path)):
        _denied(lambda c=cred, t=to: request_fd(sock, FD_WRITE, c, a.block_id, t))
    fd, _, _ = request_fd(sock, FD_WRITE, a.worker.capability, a.block_id, path)
    os.close(fd)


def test_grpc_block_calls_need_capabilities(capcluster: LocalCluster) -> None:
    cl = capcluster
    loc = _put_on_worker0(cl, f"{PREFIX}/grpc-secret", b"g" * 5000)
    stub = pbg.WorkerStub(make_channel(loc.address, None))
    key, w1 = _key(cl), cl.workers[1].worker_id
    for cap in ("", mint_for(key, w1, "r", loc.block_id), mint_for(key, cl.workers[0].worker_id, "w", loc.block_id)):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ReadBlock(pb.ReadRequest(block_id=loc.block_id, capability=cap), metadata=_md(ADMIN), timeout=5))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    got = b"".join(m.data for m in stub.ReadBlock(pb.ReadRequest(block_id=loc.block_id, capability=loc.capability),
                                                   metadata=_md(ENGINE), timeout=5))
    assert got == b"g" * 5000
    path = f"{PREFIX}/grpc-w"
    a = _allocate(cl, path, 10)
    calls = [
        lambda cap, to: stub.WriteBlock(iter([pb.WriteChunk(block_id=a.block_id, path=to, size=10, data=b"x" * 10,
                                                            capability=cap)]), metadata=_md(ENGINE), timeout=5),
        lambda cap, to: stub.ReserveLocal(pb.ReserveRequest(block_id=a.block_id, size=10, capability=cap, path=to),
                                          metadata=_md(ENGINE), timeout=5),
        lambda cap, to: stub.AdoptLocal(pb.AdoptRequest(block_id=a.block_id, path=to, size=10, capability=cap),
                                        metadata=_md(ENGINE), timeout=5),
    ]
    for call in calls:
        for cap, to in (("", path), (a.worker.capability, "/kv/ep-b/planted"),
                        (mint_for(key, w1, "w", a.block_id, path), path)):
            with pytest.raises(grpc.RpcError) as e:
                call(cap, to)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (cap, to, e.value)
    r = calls[0](a.worker.capability, path)
    assert r.size == 10


def test_touch_report_and_release_need_capabilities(capcluster: LocalCluster) -> None:
    """Touch (keep a block warm), ReportCorrupt (make the worker re-read it) and ReleaseLocal (cancel a
    reservation) took any token before; now each needs the block's capability, and repeated reports of one
    block cost one re-read."""
    cl = capcluster
    loc = _put_on_worker0(cl, f"{PREFIX}/touch-me", b"t" * 4000)
    other = _put_on_worker0(cl, f"{PREFIX}/touch-other", b"o" * 4000)
    stub = pbg.WorkerStub(make_channel(loc.address, None))
    key, w1 = _key(cl), cl.workers[1].worker_id
    bad_caps = ("", other.capability, mint_for(key, w1, "r", loc.block_id))
    for method in (stub.Touch, stub.ReportCorrupt):
        for token in (ENGINE, ADMIN):
            for cap in bad_caps:
                with pytest.raises(grpc.RpcError) as e:
                    method(pb.BlockIds(block_ids=[loc.block_id], capabilities=[cap]), metadata=_md(token), timeout=5)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (method, cap, e.value)
            with pytest.raises(grpc.RpcError) as e:  # no capabilities at all (a token-only caller)
                method(pb.BlockIds(block_ids=[loc.block_id]), metadata=_md(token), timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    hits = _metric(cl, 0, "l2fs_worker_read_hits_total")
    stub.Touch(pb.BlockIds(block_ids=[loc.block_id], capabilities=[loc.capability]), metadata=_md(ENGINE), timeout=5)
    assert _metric(cl, 0, "l2fs_worker_read_hits_total") == hits + 1
    skipped = _metric(cl, 0, "l2fs_worker_reverify_skipped_total")
    for _ in range(20):
        stub.ReportCorrupt(pb.BlockIds(block_ids=[loc.block_id], capabilities=[loc.capability]),
                           metadata=_md(ENGINE), timeout=5)
    assert _metric(cl, 0, "l2fs_worker_reverify_skipped_total") - skipped >= 19  # one re-read, not 20
    with cl.client(token=ENGINE, node_id="elsewhere") as c:
        assert c.get(f"{PREFIX}/touch-me") == b"t" * 4000  # a good block survives the reports
    # ReleaseLocal: a reservation in flight is cancelled only with its write capability (and path)
    path = f"{PREFIX}/release-me"
    a = _allocate(cl, path, 10)
    stub.ReserveLocal(pb.ReserveRequest(block_id=a.block_id, size=10, capability=a.worker.capability, path=path),
                      metadata=_md(ENGINE), timeout=5)
    for cap, to in (("", path), (loc.capability, path), (a.worker.capability, f"{PREFIX}/elsewhere")):
        with pytest.raises(grpc.RpcError) as e:
            stub.ReleaseLocal(pb.BlockIds(block_ids=[a.block_id], capabilities=[cap], paths=[to]),
                              metadata=_md(ADMIN), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (cap, to, e.value)
    with pytest.raises(grpc.RpcError) as e:  # still reserved: the refused releases changed nothing
        stub.ReserveLocal(pb.ReserveRequest(block_id=a.block_id, size=10, capability=a.worker.capability,
                                            path=path), metadata=_md(ENGINE), timeout=5)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.ReleaseLocal(pb.BlockIds(block_ids=[a.block_id], capabilities=[a.worker.capability], paths=[path]),
                      metadata=_md(ENGINE), timeout=5)
    stub.ReserveLocal(pb.ReserveRequest(block_id=a.block_id, size=10, capability=a.worker.capability, path=path),
                      metadata=_md(ENGINE), timeout=5)  # released: the id can be reserved again
    stub.ReleaseLocal(pb.BlockIds(block_ids=[a.block_id], capabilities=[a.worker.capability], paths=[path]),
                      metadata=_md(ENGINE), timeout=5)


def test_old_client_gets_a_refusal_or_a_miss_never_wrong_bytes(capcluster: LocalCluster, tmp_path: Path) -> None:
    """The client code from before capabilities (protocol 2) sends its token: its put fails and its get misses,
    each with the worker's DENIED, while a current client reads the file."""
    tree = tmp_path / "old"
    tree.mkdir()
    arch = subprocess.run(["git", "archive", PRE_CAPABILITIES, "l2fs"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=arch.stdout, check=True)
    data = os.urandom(8000)
    _put_on_worker0(capcluster, f"{PREFIX}/for-old", data)
    script = ("import sys, json\nfrom l2fs.client import Client\n"
              "c = Client(sys.argv[1], token=sys.argv[2], node_id='elsewhere', timeout=3)\n"
              "out = {'get': c.get(sys.argv[3]) is None}\n"
              "try:\n    c.put(sys.argv[3] + '-new', b'x' * 100); out['put'] = 'ok'\n"
              "except Exception as e:\n    out['put'] = type(e).__name__ + ': ' + str(e)\n"
              "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", script, capcluster.master, ENGINE, f"{PREFIX}/for-old"],
                       env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["get"] is True  # a miss
    assert out["put"] != "ok" and "capability" in out["put"], out
    with capcluster.client(token=ENGINE, node_id="elsewhere") as c:
        assert c.get(f"{PREFIX}/for-old") == data
        assert not c.exists(f"{PREFIX}/for-old-new")


# ---------- 2. normal clients in capability mode ----------

def _metric(cl: LocalCluster, i: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{cl.workers[i].metrics_port}/metrics", timeout=5).read()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.mark.parametrize("how", ["data_plane", "grpc", "fd", "path"])
def test_clients_work_end_to_end(capcluster: LocalCluster, how: str) -> None:
    cl = capcluster
    kw: dict[str, Any] = {"data_plane": how != "grpc"}
    if how in ("fd", "path"):
        kw.update(node_id="node-1", fd_passing=how == "fd")
    else:
        kw.update(node_id="elsewhere")
    items = [(f"{PREFIX}/e2e-{how}/{i}", os.urandom(5000 + i)) for i in range(6)]
    fds = _metric(cl, 0, "l2fs_worker_fdpass_fds_total")
    with cl.client(token=ENGINE, **kw) as c:
        assert c.put(items[0][0], items[0][1]) is True
        assert c.put_many(items[1:]) == [True] * 5
        assert c.get(items[0][0]) == items[0][1]
        assert c.get_many([p for p, _ in items]) == [d for _, d in items]
        assert c.locate_many([p for p, _ in items]) == 6
        buf = bytearray(10_000)
        for p, d in items:
            assert c.get_into(p, buf) == len(d) and bytes(buf[:len(d)]) == d
    assert all(_stat(cl, p).locations[0].capability for p, _ in items)  # capability mode
    if how == "fd":
        assert _metric(cl, 0, "l2fs_worker_fdpass_fds_total") - fds >= 12  # writes and reads went through fds
    else:
        assert _metric(cl, 0, "l2fs_worker_fdpass_fds_total") == fds


def test_read_after_the_ttl_locates_again(capcluster: LocalCluster) -> None:
    """Locations fetched by locate_many (kept for the client's timeout) carry capabilities that expire; the
    read is DENIED once, locates again and succeeds."""
    cl = capcluster
    items = [(f"{PREFIX}/ttl/{i}", os.urandom(3000)) for i in range(3)]
    with cl.client(token=ENGINE, node_id="elsewhere", timeout=30) as c:
        assert c.put_many(items) == [True] * 3
        assert c.locate_many([p for p, _ in items]) == 3
        exp = expiry_of(c._prefetched[items[0][0]][0].locations[0].capability)  # noqa: SLF001
        assert exp is not None
        time.sleep(max(0.0, exp - time.time()) + 1.5)  # past the TTL (the workers allow no skew here)
        loc = c._prefetched[items[0][0]][0].locations[0]  # noqa: SLF001
        _denied(lambda: _dp_read(loc, loc.capability))  # the kept capability is refused now ...
        assert [c.get(p) for p, _ in items] == [d for _, d in items]  # ... and the reads locate again


def test_sharded_masters_give_the_worker_one_key(make_cluster: Callable[..., LocalCluster]) -> None:
    cl = make_cluster(1, capacity="256M", shards=2)
    paths = [f"/shards/{i}" for i in range(16)]
    with cl.client(node_id="elsewhere") as c:
        assert {c._shard_of(p) for p in paths} == {0, 1}  # noqa: SLF001
        blobs = [os.urandom(2000) for _ in paths]
        assert c.put_many(list(zip(paths, blobs, strict=True))) == [True] * 16
        assert c.get_many(paths) == blobs  # capabilities of both shards verify on the one worker
        caps = [c._master("Stat", pb.PathRequest(path=p), shard=c._shard_of(p)).locations[0].capability  # noqa: SLF001
                for p in paths]
    assert all(caps)
    log = (cl.base / "logs" / "worker-1.log").read_text()
    assert log.count("data plane: block capabilities") == 1  # the second shard's key was the same


# ---------- 3. without a block key: token mode, as before ----------

def test_without_a_block_key_the_token_still_works(sock_dir: Path,
                                                   make_cluster: Callable[..., LocalCluster]) -> None:
    d = sock_dir / "nokey"
    d.mkdir(exist_ok=True)
    cl = _cluster(make_cluster, d, block_key=False, workers=1)
    data = os.urandom(4000)
    loc = _put_on_worker0(cl, f"{PREFIX}/plain", data)
    assert loc.capability == ""
    assert _dp_read(loc, "") == data  # any known token, as before
    fd, size, _ = request_fd(str(d / "w0.sock"), FD_READ, ENGINE, loc.block_id)
    os.close(fd)
    assert size == len(data)
    _denied(lambda: _dp_read(loc, "", token="stranger-token-0123456789"))
    with cl.client(token=ENGINE, node_id="node-1") as c:
        assert c.put(f"{PREFIX}/plain2", b"p" * 100) and c.get(f"{PREFIX}/plain2") == b"p" * 100
    wait_until(lambda: "data plane: tokens" in (cl.base / "logs" / "worker-1.log").read_text())


# ---------- 4. unit: mint, verify, expiry ----------

@pytest.mark.unit
def test_mint_and_verify() -> None:
    bk = os.urandom(32)
    k1, k2 = data_key(bk, "w1"), data_key(bk, "w2")
    assert k1 != k2 and k1 == data_key(bk, "w1") and len(k1) == 32
    bid, now = "a" * 32, int(time.time())
    r = mint(k1, "r", bid, now + 10)
    assert r.startswith(f"c1.r.{bid}.{now + 10}.") and parse(r) is not None and expiry_of(r) == now + 10
    assert why_denied(k1, r, "r", bid) is None
    assert why_denied(k1, r.encode(), "r", bid) is None
    assert why_denied(k2, r, "r", bid) is not None  # another worker's key
    assert why_denied(k1, r, "w", bid) is not None  # another op
    assert why_denied(k1, r, "r", "b" * 32) is not None  # another block
    assert why_denied(k1, r, "r", bid, now=now + 11, skew=0) is not None  # expired
    assert why_denied(k1, r, "r", bid, now=now + 11, skew=60) is None  # within the skew
    w = mint(k1, "w", bid, now + 10, "/a/b")
    assert why_denied(k1, w, "w", bid, "/a/b") is None
    assert why_denied(k1, w, "w", bid, "/a/c") is not None  # bound to its path
    assert why_denied(k1, mint(k1, "r", bid, now + 10, "/ignored"), "r", bid) is None  # reads carry no path
    with pytest.raises(ValueError):
        mint(k1, "x", bid, now)
    m = Minter(bk, ttl=100)
    assert m.key_for("w1") == k1 and why_denied(k1, m.mint("w1", "r", bid), "r", bid) is None
    assert why_denied(k1, mint_for(bk, "w1", "w", bid, "/p"), "w", bid, "/p") is None


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["", "token-0123456789", "c1.r." + "a" * 32, "c2.r." + "a" * 32 + ".1." + "0" * 32,
                                 "c1.x." + "a" * 32 + ".1." + "0" * 32, "c1.r.XYZ.1." + "0" * 32,
                                 "c1.r." + "a" * 32 + ".-1." + "0" * 32, "c1.r." + "a" * 32 + ".1." + "0" * 31,
                                 "c1.r." + "a" * 32 + ".1." + "0" * 32 + ".x", "c1.r." + "a" * 32 + "." + "9" * 30
                                 + "." + "0" * 32])
def test_malformed_capabilities_are_refused(bad: str) -> None:
    assert parse(bad) is None and expiry_of(bad) is None
    assert why_denied(os.urandom(32), bad, "r", "a" * 32) is not None


@pytest.mark.unit
def test_gate_modes() -> None:
    tokens = {b"good-token"}
    gate = DataGate(lambda t: t in tokens, skew=0)
    assert gate.check(b"good-token", "r", "a" * 32) is not None  # before registration: nothing
    assert gate.set_key(b"") and not gate.cap_mode
    assert gate.check(b"good-token", "r", "a" * 32) is None and gate.check(b"bad", "r", "a" * 32) is not None
    key = os.urandom(32)
    assert gate.set_key(key) and gate.cap_mode
    assert gate.check(b"good-token", "r", "a" * 32) is not None  # a token is not a capability
    cap = mint(key, "r", "a" * 32, int(time.time()) + 60)
    assert gate.check(cap, "r", "a" * 32) is None
    assert not gate.set_key(b"") and gate.cap_mode  # a master without a key does not reopen it
    assert capability.DEFAULT_TTL > capability.DEFAULT_SKEW > 0


@pytest.mark.unit
def test_write_capability_binds_the_allocated_size() -> None:
    """Protocol 5: a write capability minted for 1 byte verifies only for 1 byte (what a sized worker checks
    against the size a write declares); without a size it is the protocol 3-4 MAC, which a sized gate refuses,
    so an old master's capability cannot stand in for a size-bound one."""
    key, bid, exp = os.urandom(32), "a" * 32, int(time.time()) + 60
    one = mint(key, "w", bid, exp, "/p", size=1)
    assert why_denied(key, one, "w", bid, "/p", size=1) is None
    assert "size" in (why_denied(key, one, "w", bid, "/p", size=40 << 20) or "")
    assert why_denied(key, one, "w", bid, "/p") is not None  # unsized check: another MAC
    unsized = mint(key, "w", bid, exp, "/p")
    gate = DataGate(lambda t: False, skew=0)
    gate.set_key(key)
    assert gate.check(unsized, "w", bid, "/p", 1) is None  # a worker under an older master: no size bound
    gate.sized = True
    assert gate.check(unsized, "w", bid, "/p", 1) is not None
    assert gate.check(one, "w", bid, "/p", 1) is None and gate.check(one, "w", bid, "/p", 2) is not None
    assert gate.check(one, "w", bid, "/p", None) is not None  # a sized worker must say what is written
    r = mint(key, "r", bid, exp, size=5)  # reads carry no size
    assert r == mint(key, "r", bid, exp) and gate.check(r, "r", bid, "", 123) is None
