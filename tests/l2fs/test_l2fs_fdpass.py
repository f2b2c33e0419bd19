"""Short-circuit through file descriptors passed over the worker's Unix socket ("short-circuit
without handing pods the data dir").

Before, a same-node client opened block and temp files by path in the worker's data dir, so a vLLM pod had
to mount it (read-write: it could overwrite any block or the manifest). Now the worker opens the files and
passes fds; these tests run a real master and worker with a tokens file and talk to the socket as a client
that cannot see the data dir, as strangers, as an engine outside its prefix, and through a planted symlink.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest

import l2fs.client.write as client_mod  # the put path (its module-level helpers are patched)
from l2fs.common import make_channel
from l2fs.common.fdpass import (
    BAD,
    BUSY,
    DENIED,
    FD_MAX_CONNS,
    MAGIC,
    READ,
    REQ,
    WRITE,
    FdPassError,
    request_fd,
)
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.testing.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
MASTER, WORKER, ENGINE, ROUTER, ADMIN = (f"{who}-token-0123456789" for who in
                                        ("master", "worker", "engine", "router", "admin"))
PREFIX = "/kv/ep-a"
TOKENS = [{"name": name, "token": token, "role": role, **({"prefixes": [PREFIX]} if role == "engine" else {})}
          for name, token, role in (("master", MASTER, "worker"), ("worker-node-1", WORKER, "worker"),
                                    ("worker-node-2", WORKER + "-b", "worker"), ("engine-a", ENGINE, "engine"),
                                    ("router", ROUTER, "router"), ("ops", ADMIN, "admin"))]


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _cluster(factory: Callable[..., LocalCluster], sock_dir: Path, workers: int = 1) -> LocalCluster:
    """Master + workers with scoped tokens; worker i's socket at sock_dir/w<i>.sock (short: sun_path)."""
    # token mode (no block key): these tests show the socket's token scopes; in capability mode (the default)
    # a request needs the block's capability instead (test_l2fs_capabilities.py)
    return factory(workers, name="fdpass", capacity="256M", token=ADMIN, block_key=False, tokens=TOKENS,
                   master_args=["--token", MASTER],
                   each_worker_args=[["--token", WORKER if i == 0 else WORKER + "-b",
                                      "--domain-socket", str(sock_dir / f"w{i}.sock")] for i in range(workers)])


@pytest.fixture(scope="module")
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="l2fs-sock-", dir="/tmp"))  # pytest's tmp paths are too long for sun_path
    d.chmod(0o755)  # only the socket is shared: any local uid may reach it, the token decides
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def fdcluster(sock_dir: Path, cluster_factory: Callable[..., LocalCluster]) -> LocalCluster:
    return _cluster(cluster_factory, sock_dir)


def _metric(cl: LocalCluster, name: str) -> float:
    """Sum of a worker-0 metric's samples whose line starts with `name` (labels included in name)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cl.workers[0].metrics_port}/metrics", timeout=5).read()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _block_id(cl: LocalCluster, path: str) -> str:
    stub = pbg.MasterStub(make_channel(cl.host_master.split(";")[0], None))
    st = stub.Stat(pb.PathRequest(path=path), metadata=_md(ADMIN), timeout=5)
    assert st.exists and st.locations[0].domain_socket, st
    return str(st.locations[0].block_id)


def _raw(sock: str, payload: bytes) -> tuple[bytes, list[int]]:
    """Send raw bytes to the fd socket; (reply bytes, fds received)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(sock)
        try:
            s.sendall(payload)
        except BrokenPipeError:
            pass  # answered (BUSY) and closed before we finished sending: the reply is still queued
        data, fds, _, _ = socket.recv_fds(s, 4096, 4)
        return data, fds


def _req(op: int, token: str, bid: str, path: str = "") -> bytes:
    t, b, p = token.encode(), bid.encode(), path.encode()
    return REQ.pack(MAGIC, op, len(t), len(b), len(p)) + t + b + p


def _reserve(cl: LocalCluster, token: str, size: int) -> str:
    """A short-circuit reservation made the way the client makes it (ReserveLocal on the worker)."""
    bid = uuid.uuid4().hex
    stub = pbg.WorkerStub(make_channel(cl.workers[0].address, None))
    stub.ReserveLocal(pb.ReserveRequest(block_id=bid, size=size), metadata=_md(token), timeout=5)
    return bid


# A client that cannot see the worker's data dir (an empty tmpfs over it in its own mount namespace, as in a
# pod without the hostPath): it still short-circuits.
_HIDDEN_CLIENT = r"""
import json, os, sys
from l2fs.client import Client
master, node, token, prefix, data_dir, n = sys.argv[1:7]
out = {"data_dir_view": os.listdir(data_dir), "puts": [], "equal": []}
with Client(master, node_id=node, token=token, timeout=10, local_writes=True) as c:  # memfd writes, forced
    blobs = [os.urandom(100_000 + i) for i in range(int(n))]
    for i, b in enumerate(blobs):
        out["puts"].append(c.put(f"{prefix}/fd/{i}", b))
    for i, b in enumerate(blobs):
        out["equal"].append(c.get(f"{prefix}/fd/{i}") == b)
with Client(master, node_id=node, token=token, timeout=10, fd_passing=False) as c:
    out["control"] = c.get(f"{prefix}/fd/0") == blobs[0]  # path-based short-circuit impossible: data plane
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare to hide the data dir from the client")
def test_client_without_the_data_dir_short_circuits_through_fds(fdcluster: LocalCluster) -> None:
    w = fdcluster.workers[0]
    n = 4
    before = {k: _metric(fdcluster, k) for k in ('l2fs_worker_fdpass_fds_total{op="read"}',
                                                  'l2fs_worker_fdpass_fds_total{op="write"}',
                                                  "l2fs_worker_bytes_read_total")}
    hide = 'mount -t tmpfs -o mode=000 none "$0" && exec "$@"'  # this process's view: an empty dir
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", hide, str(w.data_dir),
                        sys.executable, "-c", _HIDDEN_CLIENT, fdcluster.host_master, w.node_id, ENGINE, PREFIX,
                        str(w.data_dir), str(n)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["data_dir_view"] == []  # no view of the data dir's blocks at all
    assert out["puts"] == [True] * n and out["equal"] == [True] * n and out["control"] is True
    after = {k: _metric(fdcluster, k) for k in before}
    assert after['l2fs_worker_fdpass_fds_total{op="write"}'] - before['l2fs_worker_fdpass_fds_total{op="write"}'] == n
    assert after['l2fs_worker_fdpass_fds_total{op="read"}'] - before['l2fs_worker_fdpass_fds_total{op="read"}'] == n
    # the n fd reads moved no bytes through the worker; only the control read (100,000 bytes) did
    assert after["l2fs_worker_bytes_read_total"] - before["l2fs_worker_bytes_read_total"] == 100_000


def test_same_node_writes_take_the_data_plane_unless_there_is_none(fdcluster: LocalCluster) -> None:
    """A same-node put goes over the worker's data plane by default (faster than a sealed memfd at every block size,
    `kvtier bench local-put`), through a memfd when the client has no data plane (gRPC only) or is told to; reads
    take fds in every case. Bytes read back equal in each."""
    w = fdcluster.workers[0]
    wfd = 'l2fs_worker_fdpass_fds_total{op="write"}'
    for name, kwargs, memfd in (("default", {}, False), ("grpc", {"data_plane": False}, True),
                                ("forced", {"local_writes": True}, True)):
        blob = os.urandom(300_000)
        path = f"{PREFIX}/route/{name}"
        before = _metric(fdcluster, wfd)
        with fdcluster.client(node_id=w.node_id, token=ENGINE, timeout=10, **kwargs) as c:
            assert c.local_writes is memfd, name
            assert c.put(path, blob) is True
            assert c.get(path) == blob
        assert _metric(fdcluster, wfd) - before == (1 if memfd else 0), name


def test_stranger_gets_no_fd(fdcluster: LocalCluster) -> None:
    sock = str(fdcluster.workers[0].extra_args[-1])
    with fdcluster.client(token=ADMIN) as c:
        assert c.put(f"{PREFIX}/stranger", os.urandom(10_000))
    bid = _block_id(fdcluster, f"{PREFIX}/stranger")
    for token in ("", "wrong-token-0123456789", ENGINE[:-1]):
        data, fds = _raw(sock, _req(READ, token, bid))
        assert fds == [] and data[0] == DENIED, (token, data)
        with pytest.raises(FdPassError) as e:
            request_fd(sock, READ, token, bid)
        assert e.value.status == DENIED
    data, fds = _raw(sock, b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)  # not our protocol
    assert fds == [] and data[0] == BAD
    # a known token (the router's, read-only) gets the block: reads need any known token, as on the data plane
    fd, size, _ = request_fd(sock, READ, ROUTER, bid)
    os.close(fd)
    assert size == 10_000


def test_engine_gets_no_write_fd_outside_its_prefix(fdcluster: LocalCluster) -> None:
    sock = str(fdcluster.workers[0].extra_args[-1])
    bid = _reserve(fdcluster, ENGINE, 1000)
    for token, path in ((ENGINE, "/kv/ep-b/x"), (ENGINE, "/kv/ep-a-other/x"), (ROUTER, f"{PREFIX}/x")):
        data, fds = _raw(sock, _req(WRITE, token, bid, path))
        assert fds == [] and data[0] == DENIED, (token, path, data)
    fd, _, _ = request_fd(sock, WRITE, ENGINE, bid, f"{PREFIX}/x")  # its own prefix: a fd of the reserved size
    try:
        assert os.write(fd, b"y" * 1000) == 1000
        assert os.fstat(fd).st_size == 1000
        with pytest.raises(OSError):  # sealed at the reserved size: not one byte more
            os.write(fd, b"z")
        with pytest.raises(OSError):
            os.ftruncate(fd, 1 << 20)
    finally:
        os.close(fd)
    with pytest.raises(FdPassError) as e:  # one fd per reservation
        request_fd(sock, WRITE, ENGINE, bid, f"{PREFIX}/x")
    assert e.value.status == BAD
    data, fds = _raw(sock, _req(WRITE, ADMIN, uuid.uuid4().hex, f"{PREFIX}/y"))  # nothing reserved
    assert fds == [] and data[0] == BAD


def test_planted_symlink_in_tmp_does_not_redirect_the_workers_create(fdcluster: LocalCluster, tmp_path: Path
                                                                     ) -> None:
    sock = str(fdcluster.workers[0].extra_args[-1])
    outside = tmp_path / "precious"
    outside.write_bytes(b"precious")
    bid = _reserve(fdcluster, ADMIN, 8)
    tmps = list(fdcluster.workers[0].data_dir.glob("tmp"))
    assert tmps
    (tmps[0] / f"{bid}.part").symlink_to(outside)
    fd, _, _ = request_fd(sock, WRITE, ADMIN, bid, f"{PREFIX}/planted")  # our bytes go to a memfd, not tmp/
    try:
        assert os.write(fd, b"attacker") == 8
    finally:
        os.close(fd)
    stub = pbg.WorkerStub(make_channel(fdcluster.workers[0].address, None))
    # the worker copies to a fresh name of its own and removes what was planted at the reservation's name
    r = stub.AdoptLocal(pb.AdoptRequest(block_id=bid, path=f"{PREFIX}/planted", size=8,
                                        crc32c=crc32c.crc32c(b"attacker")), metadata=_md(ADMIN), timeout=5)
    assert r.size == 8 and Path(r.local_path).read_bytes() == b"attacker"
    assert not (tmps[0] / f"{bid}.part").is_symlink()
    assert outside.read_bytes() == b"precious"
    assert outside.stat().st_mode & 0o777 != 0o600  # nothing was created or changed through the link


def test_read_fd_is_read_only(fdcluster: LocalCluster) -> None:
    sock = str(fdcluster.workers[0].extra_args[-1])
    data = os.urandom(50_000)
    with fdcluster.client(token=ADMIN) as c:
        assert c.put(f"{PREFIX}/ro", data)
    bid = _block_id(fdcluster, f"{PREFIX}/ro")
    fd, size, _ = request_fd(sock, READ, ENGINE, bid)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(OSError):
            os.write(fd, b"poison")
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        assert size == len(data) and os.pread(fd, size + 1, 0) == data
    finally:
        os.close(fd)
    with fdcluster.client(token=ADMIN) as c:
        assert c.get(f"{PREFIX}/ro") == data


def test_worker_killed_mid_write_put_goes_elsewhere(sock_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    make_cluster: Callable[..., LocalCluster]) -> None:
    """The worker dies after passing the write fd, before the client adopts: the put is retried on the
    other worker over the data plane (fresh block id), no hang, and the data reads back."""
    kdir = sock_dir / "kill"
    kdir.mkdir(exist_ok=True)
    cl = _cluster(make_cluster, kdir, workers=2)
    real = client_mod._write_fd
    killed: list[int] = []

    def die_first(fd: int, mv: memoryview) -> Any:
        if not killed:
            cl.kill_worker(0)
            killed.append(fd)
        return real(fd, mv)

    monkeypatch.setattr(client_mod, "_write_fd", die_first)
    data = os.urandom(200_000)
    with cl.client(node_id=cl.workers[0].node_id, token=ENGINE, timeout=10, local_writes=True) as c:
        t0 = time.monotonic()
        ok = c.put(f"{PREFIX}/killed", data)
        assert time.monotonic() - t0 < 10  # bounded by the client's deadline, not a hang
        assert killed, "the fd short-circuit was not used"
        assert ok is True
        assert c.get(f"{PREFIX}/killed") == data


def test_worker_refuses_too_long_socket_path(tmp_path: Path) -> None:
    """An explicit --domain-socket that cannot be bound stops the worker (exit != 0) with the reason."""
    r = subprocess.run([sys.executable, "-c", "import sys; from l2fs.worker import main; sys.exit(main(sys.argv[1:]))",
                        "--master", "127.0.0.1:1", "--data-dir",
                        str(tmp_path / "d"), "--port", "0", "--domain-socket", "/tmp/" + "x" * 120 + ".sock"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "longer than 107 bytes" in r.stderr, r.stderr



def test_idle_strangers_are_bounded_and_dropped(fdcluster: LocalCluster) -> None:
    """Connections that send nothing hold a slot for one request deadline at most; past the connection
    limit newcomers are answered BUSY at once; afterwards the socket serves again."""
    sock = str(fdcluster.workers[0].extra_args[-1])
    idle = []
    for _ in range(FD_MAX_CONNS):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock)
        s.sendall(b"L2")  # a partial header, then silence
        idle.append(s)
    try:
        time.sleep(0.3)  # let the worker accept them all
        data, fds = _raw(sock, _req(READ, ADMIN, uuid.uuid4().hex))
        assert fds == [] and data[0] == BUSY
        for s in idle:  # each is answered BAD and closed when the one request deadline passes
            s.settimeout(30)
            reply = s.recv(64)
            assert reply[:1] == bytes([BAD]) and s.recv(64) == b""
    finally:
        for s in idle:
            s.close()
    with fdcluster.client(token=ADMIN) as c:
        assert c.put(f"{PREFIX}/after-idle", b"z" * 1000)
    fd, size, _ = request_fd(sock, READ, ADMIN, _block_id(fdcluster, f"{PREFIX}/after-idle"))
    os.close(fd)
    assert size == 1000


def test_link_planted_at_the_temp_name_is_never_written_through(
        fdcluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link planted at the temp name before the client asks for the write fd: the write fd is a memfd of
    the worker's (nothing at the temp name is opened), the worker copies it to a fresh name of its own at
    adoption and removes the link; the put succeeds and the link's target is untouched."""
    w = fdcluster.workers[0]
    outside = tmp_path / "precious"
    outside.write_bytes(b"precious")
    real = client_mod.request_fd
    planted: list[Path] = []

    def plant_first(sock: str, op: int, token: str | None, bid: str, path: str = "", timeout: float = 2.0) -> Any:
        if op == WRITE:  # the attacker wins the race to the temp name
            link = w.data_dir / "tmp" / f"{bid}.part"
            link.symlink_to(outside)
            planted.append(link)
        return real(sock, op, token, bid, path, timeout)

    monkeypatch.setattr(client_mod, "request_fd", plant_first)
    data = os.urandom(70_000)
    with fdcluster.client(node_id=w.node_id, token=ENGINE, local_writes=True) as c:
        assert c.put(f"{PREFIX}/refused", data) is True
        assert c.get(f"{PREFIX}/refused") == data
    assert len(planted) == 1 and not planted[0].is_symlink()  # the link is gone
    assert outside.read_bytes() == b"precious"
