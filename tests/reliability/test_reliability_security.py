"""Access control and bad input on the l2fs gRPC surface.

Token: with --token, every master and worker RPC without the right bearer token is rejected
(UNAUTHENTICATED), including a rogue worker trying to register and a stranger reading or deleting blocks.
TLS: a TLS cluster refuses plaintext. Paths: nothing escapes the namespace or the data dirs, with or
without our client's own checks (raw gRPC requests bypass them). Sizes: absurd sizes are refused
before anything is allocated.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from reliability_faults import DEADLINE, files_under, payload, proc_pid, rss_bytes, wait_until

from l2fs.client import InvalidPath, L2fsError, PermissionDenied
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

TOKEN = "s3cret-token-for-tests"
BAD_PATHS = [
    "", "relative/path", "/a/../../etc/passwd", "/..", "/a/./b", "/a//b", "/a\x00b", "/a\nb",
    "/" + "x" * 300, "/" + "/".join(["d"] * 3000),
]


def _code(fn: Any) -> grpc.StatusCode:
    """Run a raw stub call; return its status code (OK when it succeeded)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _worker_address(client: Any) -> str:
    return client.report().workers[0].address


def _first_location(master: str, path: str, md: Any = None) -> pb.Location:
    stub = pbg.MasterStub(grpc.insecure_channel(master))
    st = stub.Stat(pb.PathRequest(path=path), timeout=DEADLINE, metadata=md)
    assert st.exists and st.locations
    return st.locations[0]


def _stranger_calls(m: Any, w: Any, block_id: str, md: Any) -> dict[str, Any]:
    """Raw master/worker calls a stranger could make, each carrying metadata md."""
    return {
        "Report": lambda: m.Report(pb.Empty(), timeout=DEADLINE, metadata=md),
        "Stat": lambda: m.Stat(pb.PathRequest(path="/sec/a"), timeout=DEADLINE, metadata=md),
        # A rogue worker registering a block that points at a host file must be turned away.
        "RegisterWorker": lambda: m.RegisterWorker(pb.RegisterRequest(
            worker_id="rogue", node_id="node-1", address="127.0.0.1:1", capacity=1 << 30,
            blocks=[pb.BlockReport(block_id="b", path="/sec/evil", size=10, local_path="/etc/passwd")]),
            timeout=DEADLINE, metadata=md),
        "Delete": lambda: m.Delete(pb.PathRequest(path="/sec/a"), timeout=DEADLINE, metadata=md),
        "ReadBlock": lambda: list(w.ReadBlock(pb.ReadRequest(block_id=block_id), timeout=DEADLINE, metadata=md)),
        "WriteBlock": lambda: w.WriteBlock(iter([pb.WriteChunk(block_id="a" * 32, path="/sec/w", size=4,
                                                               data=b"abcd")]), timeout=DEADLINE, metadata=md),
        "DeleteBlocks": lambda: w.DeleteBlocks(pb.BlockIds(block_ids=[block_id]), timeout=DEADLINE, metadata=md),
    }


# ------------------------------------------------------------------------------------------ token


def test_token_required_on_master_and_worker(make_cluster: Any) -> None:
    cluster = make_cluster(workers=1, token=TOKEN)
    good = cluster.client(token=TOKEN, timeout=DEADLINE)
    data = payload(1, 64 * 1024, "/sec/a")
    assert good.put("/sec/a", data) is True
    assert good.get("/sec/a") == data
    md = (("authorization", f"Bearer {TOKEN}"),)
    loc = _first_location(cluster.master, "/sec/a", md)
    waddr = _worker_address(good)

    for token in (None, "", "wrong", TOKEN + "x"):
        bad = cluster.client(token=token, timeout=DEADLINE, short_circuit=False)
        with pytest.raises(PermissionDenied):
            bad.exists("/sec/a")
        with pytest.raises(PermissionDenied):
            bad.put("/sec/b", data)
        assert bad.get("/sec/a") is None  # reads stay fail-as-miss
        bad.close()

    m = pbg.MasterStub(grpc.insecure_channel(cluster.master))
    w = pbg.WorkerStub(grpc.insecure_channel(waddr))
    for bad_md in (None, (("authorization", "Bearer nope"),), (("authorization", TOKEN),)):
        calls = _stranger_calls(m, w, loc.block_id, bad_md)
        for name, call in calls.items():
            assert _code(call) == grpc.StatusCode.UNAUTHENTICATED, f"{name} accepted metadata {bad_md}"
    # Nothing the strangers tried took effect.
    assert good.get("/sec/a") == data
    assert not good.exists("/sec/evil") and not good.exists("/sec/b") and not good.exists("/sec/w")
    assert all(x.worker_id != "rogue" for x in good.report().workers)


# ------------------------------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost (trustme)."""
    import trustme

    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    return {"ca": str(d / "ca.pem"), "cert": str(d / "cert.pem"), "key": str(d / "key.pem")}


def test_tls_cluster_refuses_plaintext(make_cluster: Any, certs: dict[str, str]) -> None:
    cluster = make_cluster(workers=1, tls_cert=certs["cert"], tls_key=certs["key"], tls_ca=certs["ca"],
                           token=TOKEN)
    good = cluster.client(token=TOKEN, tls_ca=certs["ca"], timeout=DEADLINE, short_circuit=False)
    data = payload(3, 64 * 1024, "/tls/a")
    assert good.put("/tls/a", data) is True
    assert good.get("/tls/a") == data  # streamed from the worker over TLS (no short-circuit)

    plain = cluster.client(token=TOKEN, tls_ca=None, timeout=DEADLINE, short_circuit=False)
    with pytest.raises(L2fsError):
        plain.exists("/tls/a")
    assert plain.get("/tls/a") is None
    m = pbg.MasterStub(grpc.insecure_channel(cluster.master))
    assert _code(lambda: m.Report(pb.Empty(), timeout=DEADLINE)) == grpc.StatusCode.UNAVAILABLE
    w = pbg.WorkerStub(grpc.insecure_channel(_worker_address(good)))
    assert _code(lambda: w.Touch(pb.BlockIds(), timeout=DEADLINE)) == grpc.StatusCode.UNAVAILABLE
    # A CA that did not sign the server's certificate is refused too.
    import trustme

    other = Path(certs["ca"]).with_name("other-ca.pem")
    trustme.CA().cert_pem.write_to_path(str(other))
    stranger = cluster.client(token=TOKEN, tls_ca=str(other), timeout=DEADLINE)
    with pytest.raises(L2fsError):
        stranger.exists("/tls/a")


# ------------------------------------------------------------------------------------------ paths


@pytest.fixture(scope="module")
def plain_cluster(cluster_factory: Callable[..., Any]) -> Any:
    # token mode: raw calls with the token (capabilities: tests/l2fs/test_l2fs_capabilities.py)
    return cluster_factory(1, name="plain", block_key=False)


@pytest.mark.parametrize("bad", BAD_PATHS, ids=range(len(BAD_PATHS)))
def test_client_rejects_bad_paths(plain_cluster: Any, bad: str) -> None:
    c = plain_cluster.client(timeout=DEADLINE)
    for fn in (lambda: c.put(bad, b"x" * 64), lambda: c.exists(bad), lambda: c.stat(bad),
               lambda: c.rm(bad), lambda: c.rename("/ok", bad), lambda: c.mkdir(bad), lambda: c.ls(bad),
               lambda: c.prefix_lookup(["/ok", bad])):
        with pytest.raises(InvalidPath):
            fn()


def test_server_rejects_bad_paths_and_ids_without_the_client(plain_cluster: Any, tmp_path: Path) -> None:
    """Raw requests (a buggy or hostile client) get INVALID_ARGUMENT, and nothing lands outside the data dir."""
    c = plain_cluster.client(timeout=DEADLINE)
    m = pbg.MasterStub(grpc.insecure_channel(plain_cluster.master))
    w = pbg.WorkerStub(grpc.insecure_channel(_worker_address(c)))
    for bad in BAD_PATHS:
        assert _code(lambda b=bad: m.Stat(pb.PathRequest(path=b), timeout=DEADLINE)) == \
            grpc.StatusCode.INVALID_ARGUMENT, repr(bad)
        assert _code(lambda b=bad: m.Allocate(pb.AllocateRequest(path=b, size=10), timeout=DEADLINE)) == \
            grpc.StatusCode.INVALID_ARGUMENT, repr(bad)
        assert _code(lambda b=bad: m.PrefixLookup(pb.PathsRequest(paths=["/x", b]), timeout=DEADLINE)) == \
            grpc.StatusCode.INVALID_ARGUMENT, repr(bad)
    escape = tmp_path / "escaped"
    data_dir = Path(plain_cluster.workers[0].data_dir).resolve()
    outside = data_dir.parent / "escaped-block"
    bad_ids = ["../escaped-block", "../../escaped-block", str(outside), "a/../../escaped-block", "a\x00b",
               "", "x" * 5000, str(escape)]
    for bid in bad_ids:
        for name, call in {
            "WriteBlock": lambda b=bid: w.WriteBlock(iter([pb.WriteChunk(block_id=b, path="/p", size=4,
                                                                         data=b"evil")]), timeout=DEADLINE),
            "ReadBlock": lambda b=bid: list(w.ReadBlock(pb.ReadRequest(block_id=b), timeout=DEADLINE)),
            "ReserveLocal": lambda b=bid: w.ReserveLocal(pb.ReserveRequest(block_id=b, size=4), timeout=DEADLINE),
            "AdoptLocal": lambda b=bid: w.AdoptLocal(pb.AdoptRequest(block_id=b, path="/p", size=4),
                                                      timeout=DEADLINE),
        }.items():
            code = _code(call)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (name, bid, code)
    assert not outside.exists() and not escape.exists()
    # Reading a host file through a block id is impossible.
    code = _code(lambda: list(w.ReadBlock(pb.ReadRequest(block_id="../../../../../../etc/passwd"),
                                          timeout=DEADLINE)))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    for p in files_under(data_dir.parent):
        assert data_dir in p.resolve().parents or p.resolve() == data_dir or "escaped" not in p.name, p


def test_absurd_sizes_refused_before_allocation(plain_cluster: Any) -> None:
    c = plain_cluster.client(timeout=DEADLINE)
    m = pbg.MasterStub(grpc.insecure_channel(plain_cluster.master))
    w = pbg.WorkerStub(grpc.insecure_channel(_worker_address(c)))
    pid = proc_pid(plain_cluster.workers[0])
    rss0 = rss_bytes(pid)
    huge = (1 << 64) - 1
    assert _code(lambda: m.Allocate(pb.AllocateRequest(path="/huge", size=huge), timeout=DEADLINE)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    for size in (huge, 1 << 40):
        assert _code(lambda s=size: w.ReserveLocal(pb.ReserveRequest(block_id="a" * 32, size=s),
                                                   timeout=DEADLINE)) != grpc.StatusCode.OK
        # A stream that claims a huge size and then sends a little: refused, nothing kept.
        assert _code(lambda s=size: w.WriteBlock(iter([pb.WriteChunk(block_id="b" * 32, path="/huge", size=s,
                                                                     data=b"x" * 1024)]),
                                                 timeout=DEADLINE)) != grpc.StatusCode.OK
    # A stream that sends more than it declared is refused (no unbounded write).
    over = iter([pb.WriteChunk(block_id="c" * 32, path="/over", size=10, data=b"x" * 4096)])
    assert _code(lambda: w.WriteBlock(over, timeout=DEADLINE)) != grpc.StatusCode.OK
    # A stream that stops short of its declared size is never adopted as a whole block.
    short = iter([pb.WriteChunk(block_id="d" * 32, path="/short", size=1 << 20, data=b"x" * 1024)])
    code = _code(lambda: w.WriteBlock(short, timeout=DEADLINE))
    assert code != grpc.StatusCode.OK
    assert c.put("/after-huge", b"y" * 1000) is True and c.get("/after-huge") == b"y" * 1000
    assert rss_bytes(pid) - rss0 < 64 << 20


# ------------------------------------------------------------------------------------------ raw-TCP data plane


def _dp(address: str, op: bytes, token: bytes, bid: str, extra: bytes = b"") -> tuple[int, bytes]:
    """One raw data-plane request; returns (status byte, rest of what the worker sent before closing)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        with contextlib.suppress(OSError):  # the worker may refuse and close before reading it all
            s.sendall(struct.pack("<4scH", b"L2D1", op, len(token)) + token
                      + bid.encode("latin-1")[:32].ljust(32, b"0") + extra)
            s.shutdown(socket.SHUT_WR)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(1 << 16):
                out += chunk
    assert out, "the data plane closed without any answer"
    return out[0], out[1:]


def _data_address(master: str, path: str, md: Any = None) -> tuple[str, str]:
    loc = _first_location(master, path, md)
    assert loc.data_address, "worker offers no raw data plane"
    return loc.data_address, loc.block_id


def test_data_plane_requires_token(make_cluster: Any) -> None:
    cluster = make_cluster(workers=1, token=TOKEN, block_key=False)  # token mode: raw calls with the token (capabilities: tests/l2fs/test_l2fs_capabilities.py)
    good = cluster.client(token=TOKEN, timeout=DEADLINE, short_circuit=False)
    data = payload(5, 64 * 1024, "/dp/a")
    assert good.put("/dp/a", data) is True
    addr, bid = _data_address(cluster.master, "/dp/a", (("authorization", f"Bearer {TOKEN}"),))
    status, rest = _dp(addr, b"R", TOKEN.encode(), bid)
    assert status == 0 and data in rest  # the right token reads
    for bad in (b"", b"wrong", TOKEN.encode() + b"x", TOKEN.encode()[:-1]):
        status, rest = _dp(addr, b"R", bad, bid)
        assert status == 2 and data[:64] not in rest, (bad, status)
        wpath = b"/dp/evil"
        status, _ = _dp(addr, b"W", bad, "e" * 32,
                        struct.pack("<H", len(wpath)) + wpath + struct.pack("<Qq", 4, 0) + b"evil")
        assert status == 2, (bad, status)
    assert good.get("/dp/a") == data
    assert not any(b"evil" in p.read_bytes() for p in files_under(cluster.workers[0].data_dir) if p.is_file()
                   and not p.name.startswith("manifest"))


def test_data_plane_rejects_bad_input(plain_cluster: Any) -> None:
    c = plain_cluster.client(timeout=DEADLINE)
    assert c.put("/dp/ok", b"o" * 4096) is True
    addr, _ = _data_address(plain_cluster.master, "/dp/ok")
    pid = proc_pid(plain_cluster.workers[0])
    rss0 = rss_bytes(pid)
    for bid in ("../../../../../../../etc/passwd", "/etc/passwd" + "0" * 21, "g" * 32, "\x00" * 32):
        assert _dp(addr, b"R", b"", bid)[0] in (1, 3), bid
    for path in (b"/../escape", b"rel", b"/a\x00b", b"/" + b"x" * 300):
        status, _ = _dp(addr, b"W", b"", "f" * 32, struct.pack("<H", len(path)) + path + struct.pack("<Qq", 4, 0) + b"evil")
        assert status == 3, path
    huge = struct.pack("<H", 5) + b"/huge" + struct.pack("<Qq", (1 << 64) - 1, 0)
    assert _dp(addr, b"W", b"", "a" * 32, huge)[0] == 3
    assert _dp(addr, b"X", b"", "a" * 32)[0] == 3  # unknown op
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert s.recv(1) == b"\x03"  # bad magic: refused, not parsed as anything else
    # A short write (fewer bytes than declared) is never published or kept.
    short = struct.pack("<H", 6) + b"/short" + struct.pack("<Qq", 1 << 20, 0) + b"x" * 1000
    with contextlib.suppress(AssertionError):
        _dp(addr, b"W", b"", "b" * 32, short)
    assert not c.exists("/short")
    leftover = [p for p in files_under(plain_cluster.workers[0].data_dir) if p.name.endswith(".part")]
    assert not leftover, f"an aborted write left temp files: {leftover}"
    assert c.get("/dp/ok") == b"o" * 4096
    assert rss_bytes(pid) - rss0 < 64 << 20


def test_reservations_without_data_do_not_evict_live_blocks(make_cluster: Any) -> None:
    """An authenticated but buggy or hostile client reserves space and never writes: the cache's live
    data must not be flushed for it. Promises beyond the worker's cap on unfinished writes are refused
    with a clear RESOURCE_EXHAUSTED, and an abandoned short-circuit reservation expires."""
    cluster = make_cluster(workers=1, capacity=str(8 << 20), heartbeat_interval=0.2,
                           worker_args=["--reservation-ttl", "2"], block_key=False)  # token mode: raw calls with the token (capabilities: tests/l2fs/test_l2fs_capabilities.py)
    c = cluster.client(timeout=DEADLINE)
    keys = [f"/resv/{i}" for i in range(20)]
    for i, k in enumerate(keys):
        assert c.put(k, payload(i, 256 * 1024, k)) is True  # 5 MiB live, under the 90 % watermark
    w = pbg.WorkerStub(grpc.insecure_channel(_worker_address(c)))
    # One large reservation is always admitted (a single big write must work); it evicts nothing.
    w.ReserveLocal(pb.ReserveRequest(block_id=f"{0:032x}", size=3 << 20), timeout=DEADLINE)
    for i in range(1, 4):
        with pytest.raises(grpc.RpcError) as ei:
            w.ReserveLocal(pb.ReserveRequest(block_id=f"{i:032x}", size=3 << 20), timeout=DEADLINE)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        assert "unfinished writes" in ei.value.details(), ei.value.details()
    present = sum(d is not None for d in c.get_many(keys))
    assert present == len(keys), f"{len(keys) - present} live objects evicted by 12 MiB of empty reservations"
    # While the promise is held, a real write to this (only) worker is a clean failure, never corruption.
    with pytest.raises(L2fsError):
        c.put("/resv/late", payload(99, 256 * 1024, "/resv/late"))
    assert c.get("/resv/late") is None
    # The abandoned reservation expires (2 s here, 30 s by default); writes work again and evict only
    # as sealed bytes cross the high watermark: the oldest objects go, the newest are kept.
    wait_until(lambda: c.put("/resv/late", payload(99, 256 * 1024, "/resv/late")) is True, 10, 0.3,
               message="the abandoned reservation was never released")
    assert c.get("/resv/late") == payload(99, 256 * 1024, "/resv/late")
    assert sum(d is not None for d in c.get_many(keys)) == len(keys), "live objects evicted under the watermark"
    # A reservation that is adopted with data evicts only when sealed bytes pass the watermark.
    for i in range(20, 40):
        assert c.put(f"/resv/{i}", payload(i, 256 * 1024, f"/resv/{i}")) is True
    newest = [f"/resv/{i}" for i in range(30, 40)]
    assert all(d is not None for d in c.get_many(newest)), "the newest objects were evicted"
    assert sum(d is not None for d in c.get_many(keys)) < len(keys), "10 MiB in 8 MiB and nothing evicted"


def test_data_plane_bounds_connections(make_cluster: Any) -> None:
    """A connection flood is refused with a clear message beyond the worker's limit (no thread per
    extra connection), idle connections are closed after the idle timeout, and once the flood is gone
    the data plane serves again."""
    cluster = make_cluster(workers=1, worker_args=["--data-max-conns", "4", "--data-idle-timeout", "1.5"],
                           block_key=False)  # token mode: raw calls with the token (capabilities: tests/l2fs/test_l2fs_capabilities.py)
    c = cluster.client(timeout=DEADLINE, short_circuit=False)
    data = payload(7, 64 * 1024, "/flood/a")
    assert c.put("/flood/a", data) is True
    c.close()  # its pooled data connection would hold a slot
    time.sleep(0.3)
    addr, bid = _data_address(cluster.master, "/flood/a")
    host, port = addr.rsplit(":", 1)
    pid = proc_pid(cluster.workers[0])
    threads0 = _threads(pid)
    flood = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.3)  # the worker accepted them all and holds a slot for each
        refused = []
        for _ in range(20):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.settimeout(5)
                head = s.recv(3, socket.MSG_WAITALL)
                assert len(head) == 3 and head[0] == 4, head  # BUSY
                (n,) = struct.unpack("<H", head[1:])
                refused.append(s.recv(n, socket.MSG_WAITALL).decode())
        assert all("too many connections (limit 4)" in m for m in refused), refused[:2]
        assert _threads(pid) <= threads0 + 4 + 2, "a thread per refused connection"
        # Our client's read through a refused connection is a miss, never a hang or wrong bytes.
        t0 = time.monotonic()
        got = cluster.client(timeout=DEADLINE, short_circuit=False).get("/flood/a")
        assert got in (None, data) and time.monotonic() - t0 < DEADLINE + 1
        # Idle connections are closed by the worker after the idle timeout.
        for s in flood:
            s.settimeout(5)
            assert s.recv(1) == b"", "an idle connection stayed open past the idle timeout"
    finally:
        for s in flood:
            s.close()
    # Slots are free again: a raw read is served.
    status, rest = _dp(addr, b"R", b"", bid)
    assert status == 0 and data in rest
    assert cluster.client(timeout=DEADLINE, short_circuit=False).get("/flood/a") == data


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
