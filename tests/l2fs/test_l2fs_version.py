"""Wire protocol versions: a rolling upgrade keeps serving, an incompatible peer is refused with
both versions named.

The old side of the rolling upgrade is the real code from before the version field (git archive of
OLD_COMMIT into tmp_path): an old worker under a new master, and a new worker and client under an old
master. The new client falls back to the unary calls when an old peer answers UNIMPLEMENTED."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import grpc
import pytest
from l2fs_helpers import wait_until

from l2fs import procs
from l2fs.client import Client
from l2fs.common import make_channel
from l2fs.common.protocol import MANIFEST_VERSION, PROTOCOL_VERSION, version_mismatch
from l2fs.master import MasterService, serve
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.testing.cluster import LocalCluster
from l2fs.worker.registration import MasterLink, VersionRefused
from l2fs.worker.store import Store

ROOT = Path(__file__).resolve().parents[2]
OLD_COMMIT = "5b8498410e71b244fed1b2f972a9c1e8f89325e1"  # the last commit before protocol versions (protocol 1)
P3_COMMIT = "d7bf43e40fc33cf96ba64589b84dbe0cefc695df"  # the last commit before seal MACs (protocol 3, manifest 1)


# ---------- the rule, in process ----------

@pytest.fixture
def master() -> Iterator[tuple[MasterService, pbg.MasterStub]]:
    service = MasterService(heartbeat_timeout=30.0)
    server, port = serve("127.0.0.1", 0, service)
    try:
        yield service, pbg.MasterStub(make_channel(f"127.0.0.1:{port}", None))
    finally:
        service.close()
        server.stop(0)


def _register(stub: pbg.MasterStub, **kw: int) -> pb.RegisterResponse:
    return stub.RegisterWorker(pb.RegisterRequest(worker_id="w1", node_id="n1", address="127.0.0.1:1", **kw))


@pytest.mark.unit
def test_master_accepts_old_worker_and_names_its_version(master: tuple[MasterService, pbg.MasterStub]) -> None:
    _, stub = master
    assert _register(stub).protocol_version == PROTOCOL_VERSION  # no field = protocol 1: served
    assert _register(stub, protocol_version=PROTOCOL_VERSION + 5).protocol_version == PROTOCOL_VERSION


@pytest.mark.unit
def test_master_refuses_incompatible_workers_naming_both(master: tuple[MasterService, pbg.MasterStub]) -> None:
    service, stub = master
    with pytest.raises(grpc.RpcError) as e:  # a future worker that needs a newer master
        _register(stub, protocol_version=9, min_protocol_version=9)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "needs protocol >= 9" in e.value.details() and f"speaks {PROTOCOL_VERSION}" in e.value.details()
    service.min_peer_version = 2  # a future master that dropped protocol 1
    with pytest.raises(grpc.RpcError) as e:
        _register(stub)  # an old worker: no version field
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "speaks l2fs protocol 1" in e.value.details() and "accepts (2)" in e.value.details()
    assert not service.workers


@pytest.mark.unit
def test_version_rule() -> None:
    assert version_mismatch("master", "worker", 0, 0) is None
    assert version_mismatch("master", "worker", 1, 1, mine=1, my_min=1) is None
    msg = version_mismatch("worker", "master", 1, 0, mine=3, my_min=2)
    assert msg is not None and "protocol 1" in msg and "protocol 3" in msg and "(2)" in msg


# ---------- a rolling upgrade with the real old code ----------

def _tree(tmp_path_factory: pytest.TempPathFactory, commit: str) -> Path:
    if not shutil.which("git") or subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", commit],
                                                 capture_output=True).returncode != 0:
        pytest.skip(f"needs git and commit {commit[:12]} in {ROOT}")
    dst = tmp_path_factory.mktemp("l2fs-old")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "l2fs"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tree(tmp_path_factory, OLD_COMMIT)


def _spawn(tree: Path, name: str, args: list[str], base: Path) -> tuple[subprocess.Popen, dict]:
    """An l2fs process from `tree` (old or new code): cwd and PYTHONPATH pick which l2fs it imports."""
    port_path = base / f"{name}.port"
    log_path = base / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = procs.spawn([sys.executable, "-m", "l2fs.cli", *args, "--port-file", str(port_path)], log_path,
                       env=env, cwd=tree)
    try:
        info = procs.wait_ready(proc, procs.port_file(port_path), timeout=60, what=f"l2fs {name}",
                                log_path=log_path)
    except procs.ProcessError:
        procs.stop(proc)
        raise
    return proc, info


def _worker_args(master: str, base: Path, node: str) -> list[str]:
    return ["worker", "--master", master, "--host", "127.0.0.1", "--port", "0", "--data-dir",
            f"{base / node}:1G", "--node-id", node, "--heartbeat-interval", "0.5"]


def _roundtrip(c: Client, prefix: str) -> None:
    items = [(f"{prefix}/{i}", os.urandom(5000 + i)) for i in range(8)]
    assert c.put_many(items) == [True] * 8
    assert c.put_many(items[:2]) == [False, False]
    for p, d in items:
        assert c.get(p) == d


def _roundtrip_get(c: Client, prefix: str) -> None:
    for i in range(8):
        got = c.get(f"{prefix}/{i}")
        assert got is not None and len(got) == 5000 + i


def test_new_master_serves_old_worker(old_tree: Path, tmp_path: Path,
                                       make_cluster: Callable[..., LocalCluster]) -> None:
    cl = make_cluster(1, capacity="1G")
    proc, _ = _spawn(old_tree, "old-worker", _worker_args(cl.master, tmp_path, "node-old"), tmp_path)
    try:
        with cl.client(node_id="node-old") as c:
            wait_until(lambda: len([w for w in c.report().workers if w.alive]) == 2, timeout=30)
            _roundtrip(c, "/v/oldworker/local")  # short-circuit to the old worker: unary reserve/adopt
            assert "node-old" in c.stat("/v/oldworker/local/0").nodes  # type: ignore[union-attr]
        with cl.client(node_id="node-1") as c:
            _roundtrip(c, "/v/oldworker/new")
    finally:
        procs.stop(proc)


def test_old_master_serves_new_worker_and_client(old_tree: Path, tmp_path: Path) -> None:
    mproc, info = _spawn(old_tree, "old-master", ["master", "--host", "127.0.0.1", "--port", "0"], tmp_path)
    master = f"127.0.0.1:{info['port']}"
    wproc, _ = _spawn(ROOT, "new-worker", _worker_args(master, tmp_path, "node-new"), tmp_path)
    try:
        with Client(master, node_id="node-new") as c:
            wait_until(lambda: any(w.alive for w in c.report().workers), timeout=30)
            _roundtrip(c, "/v/oldmaster/local")
        with Client(master, node_id="elsewhere") as c:
            _roundtrip(c, "/v/oldmaster/remote")
        log = (tmp_path / "new-worker.log").read_text()
        assert f"master protocol 1, ours {PROTOCOL_VERSION}" in log
        # a worker that needs protocol 2 refuses this master, naming both versions, and stays unregistered
        link = MasterLink(Store([(tmp_path / "strict", 1 << 20)]), master=master, tls_ca=None, token=None,
                          worker_id="strict", node_id="n-strict", address="127.0.0.1:2", data_address="",
                          heartbeat_interval=1.0)
        link.min_peer_version = 2
        with pytest.raises(VersionRefused, match=rf"master speaks l2fs protocol 1.*\(protocol {PROTOCOL_VERSION}\) accepts \(2\)"):
            link._register()  # noqa: SLF001
        assert not link.registered
    finally:
        procs.stop(wproc)
        procs.stop(mproc)


def test_protocol3_worker_under_sealing_master_then_upgraded(tmp_path_factory: pytest.TempPathFactory,
                                                             tmp_path: Path,
                                                             make_cluster: Callable[..., LocalCluster]) -> None:
    """Protocol 4 (seal MACs), rolling upgrade: a protocol-3 worker (the real code from before seals) under a new
    master with a block key serves puts and gets; after a master restart its blocks are not published again (it
    holds no seals: deleted, its own allocations). The same data dir under the new worker (manifest 1 -> 2): its
    files are sealed, and served again after another master restart."""
    p3 = _tree(tmp_path_factory, P3_COMMIT)
    cl = make_cluster(0)
    args = _worker_args(cl.master, tmp_path, "node-p3")
    proc, _ = _spawn(p3, "p3-worker", args, tmp_path)
    try:
        with cl.client(node_id="node-p3") as c:
            wait_until(lambda: any(w.alive for w in c.report().workers), timeout=30)
            _roundtrip(c, "/v/p3/a")
            cl.kill_master()
            cl.start_master()
            wait_until(lambda: any(w.alive for w in c.report().workers), timeout=30)
            assert c.stat("/v/p3/a/0") is None  # unsealed: not published after the restart
            _roundtrip(c, "/v/p3/b")  # still serves new puts
    finally:
        procs.stop(proc)
    proc, _ = _spawn(ROOT, "upgraded-worker", args, tmp_path)  # same data dir, new code
    try:
        assert _user_version(tmp_path / "node-p3") == MANIFEST_VERSION
        with cl.client(node_id="node-p3") as c:
            wait_until(lambda: any(w.alive for w in c.report().workers), timeout=30)
            _roundtrip(c, "/v/p3/c")
            with closing(sqlite3.connect(tmp_path / "node-p3" / "manifest.sqlite3")) as db:
                wait_until(lambda: db.execute("SELECT count(*) FROM blocks WHERE seal != ''").fetchone()[0] >= 8,
                           timeout=15)
            cl.kill_master()
            cl.start_master()
            wait_until(lambda: c.stat("/v/p3/c/0") is not None, timeout=30)
            _roundtrip_get(c, "/v/p3/c")
    finally:
        procs.stop(proc)


# ---------- the worker manifest's format version ----------

def _user_version(data_dir: Path) -> int:
    with closing(sqlite3.connect(data_dir / "manifest.sqlite3")) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def test_worker_stamps_old_manifest_and_refuses_a_newer_one(tmp_path: Path) -> None:
    d = tmp_path / "node-m"
    store = Store([(d, 1 << 20)])  # a manifest as every worker wrote it before the stamp
    for dd in store.dirs:
        dd.db.close()
    assert _user_version(d) == 0
    proc, _ = _spawn(ROOT, "stamping-worker", _worker_args("127.0.0.1:1", tmp_path, "node-m"), tmp_path)
    try:
        assert _user_version(d) == MANIFEST_VERSION  # read as format 1 and stamped
    finally:
        procs.stop(proc)
    with closing(sqlite3.connect(d / "manifest.sqlite3")) as db:
        db.execute("PRAGMA user_version=99")  # written by some future worker
    out = subprocess.run([sys.executable, "-m", "l2fs.cli", *_worker_args("127.0.0.1:1", tmp_path, "node-m")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert "manifest format 99" in out.stderr and f"up to {MANIFEST_VERSION}" in out.stderr
    assert _user_version(d) == 99  # left as it was
