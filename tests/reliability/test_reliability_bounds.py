"""Bounds on what one credential (or one slow peer) may hold of a shared master or worker, against real
processes on loopback: exact node identity for worker ids, bounded metadata calls, slow clients that cannot
hold the data plane, the worker's gRPC threads or the metrics ports, and a private worker manifest.

Each test is the attack an audit reproduced on the deployed configuration (scoped tokens, block key,
node-bound worker credentials), shrunk to seconds by the knobs each bound has.
"""

from __future__ import annotations

import http.client
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from polling import wait_until
from test_reliability_security import _code

from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.testing.cluster import LocalCluster

MASTER = "master-token-0123456789"
WORKER_1 = "worker-1-token-0123456789"  # node "node-1"
WORKER_GPU = "worker-gpu-token-0123456789"  # node "node-1-gpu": a name node-1's starts
ENGINE = "engine-token-0123456789"
ADMIN = "admin-token-01234567890"
PREFIX = "/kvtier/kv/ep-a"
TOKENS = [
    {"name": "master", "token": MASTER, "role": "worker"},
    {"name": "worker-node-1", "token": WORKER_1, "role": "worker", "node": "node-1"},
    {"name": "worker-node-1-gpu", "token": WORKER_GPU, "role": "worker", "node": "node-1-gpu"},
    {"name": "engine-a", "token": ENGINE, "role": "engine", "prefixes": [PREFIX]},
    {"name": "ops", "token": ADMIN, "role": "admin"},
]
T = 10.0  # RPC deadline


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _master(c: LocalCluster) -> pbg.MasterStub:
    return pbg.MasterStub(grpc.insecure_channel(c.master))


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


@pytest.fixture
def scoped(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    """Master (block key, tokens file, 3 s heartbeat timeout) + workers of nodes "node-1" and "node-1-gpu",
    each with its own node-bound credential; the cluster's own clients use ADMIN."""
    return make_cluster(2, capacity="256M", heartbeat_timeout=3, heartbeat_interval=0.5, token=ADMIN, tokens=TOKENS,
                        master_args=["--token", MASTER], node_ids=["node-1", "node-1-gpu"],
                        each_worker_args=[["--token", WORKER_1], ["--token", WORKER_GPU]])


def _ids(c: LocalCluster) -> dict[str, str]:
    with c.client() as cl:
        return {w.node_id: w.worker_id for w in cl.report().workers if w.alive}


# ---------- exact node identity ----------

def test_bounds_node_credential_cannot_take_a_node_whose_name_extends_its_own(scoped: LocalCluster) -> None:
    """node-1's worker credential registering node-1-gpu's worker id (its name starts with "node-1-") after a
    master restart, while that worker is down (no in-memory owner binding left): refused, whichever node id
    it claims; node-1-gpu's worker then registers its own id again and its files read back."""
    ids = _ids(scoped)
    victim = ids["node-1-gpu"]
    with scoped.client(node_id="node-1-gpu", timeout=T) as cl:
        assert cl.put(f"{PREFIX}/gpu", b"g" * 50_000) is True
    scoped.kill_worker(1)
    scoped.kill_master()
    scoped.start_master()
    m = _master(scoped)
    for node in ("node-1", "node-1-gpu"):
        reg = pb.RegisterRequest(worker_id=victim, node_id=node, address="127.0.0.1:1", capacity=1 << 30)
        assert _code(lambda r=reg: m.RegisterWorker(r, timeout=T, metadata=_md(WORKER_1))) \
            == grpc.StatusCode.PERMISSION_DENIED, node
    assert _code(lambda: m.Heartbeat(pb.HeartbeatRequest(worker_id=victim), timeout=T, metadata=_md(WORKER_1))) \
        == grpc.StatusCode.PERMISSION_DENIED
    scoped.start_worker(1)
    assert _ids(scoped)["node-1-gpu"] == victim
    with scoped.client(timeout=T) as cl:
        assert cl.get(f"{PREFIX}/gpu") == b"g" * 50_000


def test_bounds_worker_registrations_per_credential_are_bounded(scoped: LocalCluster) -> None:
    """One node credential registering 60 ids of its own node's form: the master keeps a bounded number of
    that credential's entries (the oldest dead ones give way), not 60, and the real workers stay alive."""
    ids = _ids(scoped)
    own = ids["node-1"]
    form = own[:len("node-1") + 1]  # the separator a worker id of node-1 takes after the node name
    m = _master(scoped)
    codes = []
    for i in range(60):
        reg = pb.RegisterRequest(worker_id=f"{form}fake{i:03d}", node_id="node-1", address="127.0.0.1:1",
                                 capacity=1 << 20)
        codes.append(_code(lambda r=reg: m.RegisterWorker(r, timeout=T, metadata=_md(WORKER_1))))
    assert grpc.StatusCode.OK in codes  # its own node's form: the binding, not a blanket refusal
    with scoped.client() as cl:
        entries = [w for w in cl.report().workers if w.node_id == "node-1"]
    assert len(entries) <= 16, f"{len(entries)} entries of one node credential kept"
    assert any(w.worker_id == own and w.alive for w in entries), "the real worker was pushed out"
    assert set(_ids(scoped)) == {"node-1", "node-1-gpu"}


def test_bounds_dead_worker_entries_are_forgotten(make_cluster: Callable[..., LocalCluster]) -> None:
    """A worker entry dead for longer than --forget-dead-after is dropped from the master (a stopped node's
    id no longer lists forever); a live one stays."""
    c = make_cluster(2, capacity="64M", heartbeat_timeout=2, heartbeat_interval=0.5,
                     master_args=["--forget-dead-after", "2"])
    ids = _ids(c)
    c.kill_worker(1)
    def listed_without_node_2() -> set[str] | None:
        with c.client() as cl:
            listed = {w.worker_id for w in cl.report().workers}
        return listed if ids["node-2"] not in listed else None

    listed = wait_until(listed_without_node_2, 20, 0.3, message="the dead worker's entry was never dropped")
    assert ids["node-1"] in listed


# ---------- bounded metadata calls ----------

@pytest.fixture
def quota(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    """One worker; the engine's prefix has a 256 KiB quota."""
    return make_cluster(1, capacity="256M", token=ADMIN, tokens=TOKENS,
                        master_args=["--token", MASTER, "--prefix-quota", f"{PREFIX}=256KiB"],
                        worker_args=["--token", MASTER])


def test_bounds_mkdir_of_a_deep_path_is_refused_and_directories_count(quota: LocalCluster) -> None:
    """Mkdir(parents) of a 4 KiB path of one-letter components (about 2,000 directories in one call) is
    INVALID_ARGUMENT; directories under a quota prefix count against it, so an engine making directories
    is refused once the prefix is full, and the namespace keeps only what was admitted."""
    m = _master(quota)
    deep = PREFIX + "/a" * 2000
    assert len(deep) > 4000
    t0 = time.monotonic()
    code = _code(lambda: m.Mkdir(pb.MkdirRequest(path=deep, parents=True, exist_ok=True), timeout=T,
                                 metadata=_md(ENGINE)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, code
    assert time.monotonic() - t0 < 2.0
    codes = [_code(lambda i=i: m.Mkdir(pb.MkdirRequest(path=f"{PREFIX}/d{i}", parents=True, exist_ok=True),
                                       timeout=T, metadata=_md(ENGINE))) for i in range(200)]
    made = codes.count(grpc.StatusCode.OK)
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, "200 directories fit a 256 KiB quota"
    assert 0 < made < 200
    listed = m.List(pb.PathRequest(path=PREFIX), timeout=T, metadata=_md(ADMIN)).entries
    assert len(listed) == made
    # removing directories gives their share back
    for i in range(made):
        m.Delete(pb.PathRequest(path=f"{PREFIX}/d{i}"), timeout=T, metadata=_md(ADMIN))
    assert _code(lambda: m.Mkdir(pb.MkdirRequest(path=f"{PREFIX}/again", parents=True), timeout=T,
                                 metadata=_md(ENGINE))) == grpc.StatusCode.OK


def test_bounds_batched_calls_are_bounded_in_items(quota: LocalCluster) -> None:
    """StatMany of 200,000 copies of one path, and PrefixLookup, AllocateMany, CommitMany as long: refused
    as INVALID_ARGUMENT at once, without minting a capability; a Stat from another client meanwhile answers
    promptly; the client library splits long batches itself, so its stat_many of 10,000 paths still works."""
    m = _master(quota)
    with quota.client(timeout=T) as cl:
        assert cl.put(f"{PREFIX}/x", b"x" * 1000) is True
    many = [f"{PREFIX}/x"] * 200_000
    slow: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            m.Stat(pb.PathRequest(path=f"{PREFIX}/x"), timeout=30, metadata=_md(ADMIN))
            slow.append(time.monotonic() - t0)
            time.sleep(0.05)

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        code = _code(lambda: m.StatMany(pb.PathsRequest(paths=many), timeout=60, metadata=_md(ENGINE)))
        took = time.monotonic() - t0
    finally:
        stop.set()
        th.join(timeout=30)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, took)
    assert max(slow, default=0) < 1.0, f"a Stat waited {max(slow):.2f} s behind the batch"
    assert _code(lambda: m.PrefixLookup(pb.PathsRequest(paths=many), timeout=60, metadata=_md(ENGINE))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    items = [pb.AllocateRequest(path=f"{PREFIX}/y{i}", size=1, if_absent=True) for i in range(20_000)]
    assert _code(lambda: m.AllocateMany(pb.AllocateManyRequest(items=items), timeout=60, metadata=_md(ENGINE))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    with quota.client(timeout=T, token=ENGINE) as cl:
        stats = cl.stat_many([f"{PREFIX}/x"] * 10_000)
    assert len(stats) == 10_000 and all(s is not None and s.size == 1000 for s in stats)


def test_bounds_list_of_a_large_directory_is_paged(quota: LocalCluster) -> None:
    """A directory of 5,000 files: a List asking for no page is INVALID_ARGUMENT (it was one reply built
    under the lock, however large), a page holds at most 4,096 entries and names where to go on, and the
    client's ls pages through to the whole sorted listing."""
    with quota.client(timeout=30) as cl:
        res = cl.put_many([(f"/many/f{i:05d}", b"m") for i in range(5000)])
        assert all(r is True for r in res)
        m = _master(quota)
        assert _code(lambda: m.List(pb.PathRequest(path="/many"), timeout=T, metadata=_md(ADMIN))) \
            == grpc.StatusCode.INVALID_ARGUMENT
        page = m.List(pb.ListRequest(path="/many", limit=100_000), timeout=T, metadata=_md(ADMIN))
        assert len(page.entries) == 4096 and page.next_after == "f04095"
        rest = m.List(pb.ListRequest(path="/many", start_after=page.next_after, limit=4096), timeout=T,
                      metadata=_md(ADMIN))
        assert len(rest.entries) == 904 and rest.next_after == ""
        names = [e.path.rsplit("/", 1)[1] for e in cl.ls("/many")]
        assert names == [f"f{i:05d}" for i in range(5000)]


# ---------- slow clients ----------

def _read_header(cap: str, bid: str) -> bytes:
    c = cap.encode()
    return b"L2D1R" + struct.pack("<H", len(c)) + c + bid.encode()


def _read_reply(s: socket.socket) -> int:
    """Status of one data-plane read answer (the body read and dropped)."""
    st = s.recv(1, socket.MSG_WAITALL)[0]
    if st == 0:
        size, _ = struct.unpack("<QI", s.recv(12, socket.MSG_WAITALL))
        left = size
        while left:
            left -= len(s.recv(min(left, 1 << 16)))
    else:
        (n,) = struct.unpack("<H", s.recv(2, socket.MSG_WAITALL))
        s.recv(n, socket.MSG_WAITALL)
    return st


def test_bounds_data_plane_header_deadline_is_not_restarted_per_byte(
        make_cluster: Callable[..., LocalCluster]) -> None:
    """32 authenticated data-plane connections (a read each, from two addresses) on a worker with 32 slots,
    each then trickling the next request header one byte per second (the idle timeout is 2 s, so each byte
    would restart it): once the whole-header deadline has passed, a fresh connection's read is served, not
    answered BUSY."""
    c = make_cluster(1, capacity="64M", worker_args=["--data-max-conns", "32", "--data-idle-timeout", "2"])
    with c.client(timeout=T) as cl:
        assert cl.put("/slow/a", b"s" * 10_000) is True
    loc = _master(c).Stat(pb.PathRequest(path="/slow/a"), timeout=T).locations[0]
    host, port = loc.data_address.rsplit(":", 1)
    head = _read_header(loc.capability, loc.block_id)
    socks = []
    for k in range(32):  # from two addresses (each may hold half the slots)
        s = socket.create_connection((host, int(port)), timeout=5, source_address=(f"127.0.0.{2 + k % 2}", 0))
        s.sendall(head)
        assert _read_reply(s) == 0
        socks.append(s)
    stop = threading.Event()

    def trickle() -> None:
        i = 0
        while not stop.wait(1.0):
            for s in socks:
                try:
                    s.send(head[i % len(head):i % len(head) + 1])
                except OSError:
                    pass
            i += 1

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    try:
        time.sleep(6.0)  # past a whole-header deadline (2 s here) and several restarted idle timers
        fresh = socket.create_connection((host, int(port)), timeout=5)
        fresh.sendall(head)
        status = _read_reply(fresh)
        fresh.close()
    finally:
        stop.set()
        th.join(timeout=5)
        for s in socks:
            s.close()
    assert status == 0, f"a fresh read was answered {status} (4 = BUSY: all slots held by tricklers)"


def test_bounds_one_address_holds_at_most_half_the_data_plane_slots(make_cluster: Callable[..., LocalCluster]) -> None:
    """A worker with 8 data-plane slots; 8 connections from one address each make a valid read and stay
    open: the 5th and later are answered BUSY (half the slots per peer address), and a client at another
    address is served meanwhile (before: every slot held by the first address, the client answered BUSY)."""
    c = make_cluster(1, capacity="64M", worker_args=["--data-max-conns", "8"])
    with c.client(timeout=T) as cl:
        assert cl.put("/half/a", b"h" * 10_000) is True
    time.sleep(0.3)  # the client's pooled connection is closed
    loc = _master(c).Stat(pb.PathRequest(path="/half/a"), timeout=T).locations[0]
    host, port = loc.data_address.rsplit(":", 1)
    head = _read_header(loc.capability, loc.block_id)
    socks, statuses = [], []
    try:
        for _ in range(8):
            s = socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.1", 0))
            s.sendall(head)
            statuses.append(_read_reply(s))
            socks.append(s)
        other = socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0))
        other.sendall(head)
        status = _read_reply(other)
        other.close()
    finally:
        for s in socks:
            s.close()
    assert statuses[:4] == [0] * 4 and statuses[4:] == [4] * 4, statuses
    assert status == 0, f"a client at another address was answered {status} (4 = BUSY)"


def test_bounds_unread_grpc_read_streams_leave_the_masters_calls_served(
        make_cluster: Callable[..., LocalCluster]) -> None:
    """48 ReadBlock streams of a 16 MiB block, one connection each, that the caller never reads (the worker
    has 32 gRPC threads): a same-node put (its reserve/adopt calls) still succeeds, and a delete reaches the
    worker (the master's DeleteBlocks call), within seconds."""
    c = make_cluster(1, capacity="256M", heartbeat_interval=0.5)
    with c.client(timeout=T) as cl:
        assert cl.put("/big/a", os.urandom(16 << 20)) is True
        assert cl.put("/big/gone", b"z" * 30_000) is True
    st = _master(c).Stat(pb.PathRequest(path="/big/a"), timeout=T)
    loc = st.locations[0]
    gone_bid = _master(c).Stat(pb.PathRequest(path="/big/gone"), timeout=T).locations[0].block_id
    # one connection each (a shared one would be throttled as a whole by HTTP/2 flow control)
    chans = [grpc.insecure_channel(loc.address, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(48)]
    streams = [pbg.WorkerStub(ch).ReadBlock(pb.ReadRequest(block_id=loc.block_id, capability=loc.capability),
                                            timeout=60) for ch in chans]
    try:
        time.sleep(1.5)  # the worker has started them all (or refused the excess)
        t0 = time.monotonic()
        with c.client(node_id="node-1", timeout=T) as local:
            ok = local.put("/big/local", b"l" * 100_000)
            local.rm("/big/gone")
        took = time.monotonic() - t0
        assert ok is True, "same-node put failed while unread streams held the worker"
        data_dir = c.workers[0].data_dir
        wait_until(lambda: not any(gone_bid in p.name for p in data_dir.rglob("*")), 10, 0.2,
                   message="the master's DeleteBlocks never reached the worker")
        assert took < T
    finally:
        for s in streams:
            s.cancel()
        for ch in chans:
            ch.close()


def test_bounds_half_sent_metrics_requests_hold_no_threads(make_cluster: Callable[..., LocalCluster]) -> None:
    """150 connections to a worker's /metrics port that send half a request line and stop: the worker does
    not keep a thread per connection, and /metrics still answers a scraper at another address."""
    c = make_cluster(1, capacity="64M")
    w = c.workers[0]
    assert w.proc is not None and w.metrics_port
    base = _threads(w.proc.pid)
    socks = []
    try:
        for _ in range(150):
            s = socket.create_connection(("127.0.0.1", w.metrics_port), timeout=5)
            s.sendall(b"GET /metr")
            socks.append(s)
        time.sleep(1.0)
        grew = _threads(w.proc.pid) - base
        t0 = time.monotonic()
        scrape = http.client.HTTPConnection("127.0.0.1", w.metrics_port, timeout=10,
                                            source_address=("127.0.0.2", 0))
        scrape.request("GET", "/metrics")
        body = scrape.getresponse().read()
        scrape.close()
        assert b"l2fs_" in body and time.monotonic() - t0 < 5
    finally:
        for s in socks:
            s.close()
    assert grew < 40, f"{grew} threads held by 150 half-sent requests"


# ---------- node-local exposure ----------

def test_bounds_worker_manifest_is_private_also_when_made_before(tmp_path: Path,
                                                                 make_cluster: Callable[..., LocalCluster]) -> None:
    """The worker's data dir is 0700 and its manifest, WAL and worker id 0600; a data dir made world
    readable before (an older worker, a hand-made dir) is tightened when the worker starts."""
    d = tmp_path / "c" / "worker-1"
    d.mkdir(parents=True)
    d.chmod(0o755)
    (d / "manifest.sqlite3").touch(mode=0o644)
    (d / "manifest.sqlite3").chmod(0o644)
    c = make_cluster(1, name="c", capacity="64M")
    assert c.workers[0].data_dir == d
    with c.client(timeout=T) as cl:
        assert cl.put("/priv/a", b"p" * 10_000) is True
    assert stat.S_IMODE(d.stat().st_mode) == 0o700, oct(d.stat().st_mode)
    files = [p for p in d.iterdir() if p.name.startswith("manifest") or p.name == "worker_id"]
    assert any(p.name.endswith("-wal") for p in files), [p.name for p in files]
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, (p.name, oct(p.stat().st_mode))
