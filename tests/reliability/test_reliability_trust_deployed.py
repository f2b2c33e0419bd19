"""Trust as deployed: what one pod credential must not do to another endpoint's cache, against real master,
worker and mount processes on loopback with a scoped tokens file and a block key (what `kvtier tokens generate`
and deploy/ give every cluster).

- A commit is bound to its allocation: an engine of endpoint A that learned B's block ids (once from its own
  `Stat`; since read scopes from a wider view only) cannot
  commit them, neither onto a path A owns (the master took them for A's lost-race orphans and deleted B's
  blocks) nor under a fresh path (B's block re-sealed for A's path: B's file gone after a master restart).
- The writer's checksum, not the worker's: a compromised worker that stores altered bytes and answers with
  their CRC32C fails the put (every write path: network put, put_many, gRPC, same-node fd, fsspec, FUSE); one
  that answers the writer's CRC instead has its reads miss. Never wrong bytes.
- Write capabilities carry the allocated size, and the data plane, the gRPC write and the same-node fd path
  hold a writer to it: allocating 1 byte and sending 40 MiB evicted 16 of B's 40 chunks before.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import grpc
import pytest
from polling import wait_until
from reliability_faults import DEADLINE, payload

from l2fs import procs
from l2fs.client import Client, L2fsError
from l2fs.common import make_channel
from l2fs.common.capability import NOT_READY
from l2fs.common.fdpass import WRITE as FD_WRITE
from l2fs.common.fdpass import request_fd
from l2fs.dataplane import DataClient, DataPlaneError
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

MASTER = "master-token-0123456789abcdef"
WORKER = "worker-token-0123456789abcdef"
ENGINE_A = "engine-a-token-0123456789abcdef"
ENGINE_B = "engine-b-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
KV = "/kvtier/kv"
A, B = f"{KV}/ep-a", f"{KV}/ep-b"
TOKENS = [
    {"name": "master", "token": MASTER, "role": "worker"},
    {"name": "worker", "token": WORKER, "role": "worker"},
    {"name": "engine-ep-a", "token": ENGINE_A, "role": "engine", "prefixes": [A]},
    {"name": "engine-ep-b", "token": ENGINE_B, "role": "engine", "prefixes": [B]},
    {"name": "ops", "token": ADMIN, "role": "admin"},
]
EVIL = Path(__file__).resolve().parent / "reliability_evil_worker.py"


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _tokens(tmp_path: Path) -> Path:
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps(TOKENS))
    return f


def _scoped(make_cluster: Any, tmp_path: Path, *, workers: int = 1, capacity: str = "256M",
            master: list[str] = (), worker: list[str] = ()) -> Any:  # type: ignore[assignment]
    f = _tokens(tmp_path)
    return make_cluster(workers=workers, capacity=capacity, token=ADMIN,
                        master_args=["--tokens-file", str(f), "--token", MASTER, *master],
                        worker_args=["--tokens-file", str(f), "--token", WORKER, *worker])


def _wait(cond: Any, timeout: float = 15.0, what: str = "condition") -> Any:
    """polling.wait_until, failing with what this file waits for."""
    try:
        return wait_until(cond, timeout, 0.1)
    except AssertionError as e:
        raise AssertionError(f"{what} not reached in {timeout} s") from e


# ---------- 1. a commit is bound to its allocation ----------

def test_trust_commit_of_another_endpoints_blocks_is_refused(make_cluster: Any, tmp_path: Path) -> None:
    """Engine A learns B's 8 block ids, worker and sizes (not from its own Stat any more: read scopes answer B's
    paths to A as missing, test_reliability_read_scopes.py; here from a wider view, the admin's, as a leaked
    router or node-mount answer would give them) and commits them: onto a path A owns (put-if-absent: before,
    the master took them as A's orphans and had the worker delete them), under fresh paths of A's with B's CRC (before: re-sealed for A's path, so B's file was gone after a master
    restart) and with a wrong CRC (before: dropped by the worker as corrupt). Now every such commit is refused
    and B's 8 chunks read back byte-exact, before and after a master restart; A's own puts still work."""
    cl = _scoped(make_cluster, tmp_path)
    chunks = {f"{B}/c{i}": payload(i, 64 * 1024, f"b{i}") for i in range(8)}
    with cl.client(token=ENGINE_B, timeout=DEADLINE) as b:
        assert all(b.put_many(list(chunks.items())))
    with cl.client(token=ENGINE_A, timeout=DEADLINE) as a:
        assert a.put(f"{A}/mine", b"a" * 1000) is True
    m = pbg.MasterStub(make_channel(cl.master, None))
    assert not any(m.Stat(pb.PathRequest(path=p), timeout=5, metadata=_md(ENGINE_A)).exists for p in chunks)
    stats = [m.Stat(pb.PathRequest(path=p), timeout=5, metadata=_md(ADMIN)) for p in chunks]
    assert all(st.exists and st.locations for st in stats)
    onto_mine = [pb.CommitRequest(path=f"{A}/mine", block_id=st.locations[0].block_id,
                                  worker_id=st.locations[0].worker_id, size=st.size, crc32c=st.crc32c,
                                  if_absent=True) for st in stats]
    fresh = [pb.CommitRequest(path=f"{A}/stolen{i}", block_id=st.locations[0].block_id,
                              worker_id=st.locations[0].worker_id, size=st.size,
                              crc32c=st.crc32c if i % 2 else st.crc32c ^ 1, if_absent=True)
             for i, st in enumerate(stats)]
    answers = [m.CommitMany(pb.CommitManyRequest(items=reqs), timeout=5, metadata=_md(ENGINE_A)).items
               for reqs in (onto_mine, fresh)]
    unary = []
    for r in fresh:  # the unary call too
        try:
            unary.append(m.Commit(r, timeout=5, metadata=_md(ENGINE_A)))
        except grpc.RpcError as e:
            unary.append(e.code())
    time.sleep(3.0)  # the master's deletes go out in the background (the pusher wakes at once, runs every 1 s)

    def intact() -> None:
        with cl.client(token=ENGINE_B, timeout=DEADLINE) as b, cl.client(token=ADMIN, timeout=DEADLINE) as admin:
            assert [b.get(p) == d for p, d in chunks.items()] == [True] * len(chunks)
            assert [b.put(p, d) for p, d in chunks.items()] == [False] * len(chunks)  # still there: "exists"
            assert [admin.stat(f"{A}/stolen{i}") for i in range(len(stats))] == [None] * len(stats)
            assert admin.get(f"{A}/mine") == b"a" * 1000

    intact()
    denied = grpc.StatusCode.PERMISSION_DENIED
    for items in answers:
        assert [r.error.code if r.HasField("error") else 0 for r in items] == [denied.value[0]] * len(items), items
    assert unary == [denied] * len(fresh)
    cl.kill_master()
    cl.start_master()
    cl.wait_workers(1)
    _wait(lambda: all(cl.client(token=ADMIN).stat(p) for p in chunks), what="B's files republished")
    intact()


def test_trust_commit_is_bound_to_the_allocating_credential_path_and_size(make_cluster: Any,
                                                                           tmp_path: Path) -> None:
    """An open allocation is A's alone: committed by another credential, under another path, or for another
    size it is refused and stays open (A's own commit still publishes it); a commit of an id no master
    allocated is refused as well."""
    cl = _scoped(make_cluster, tmp_path)
    m = pbg.MasterStub(make_channel(cl.master, None))
    path = f"{A}/alloc"
    data = b"z" * 4096
    a = m.Allocate(pb.AllocateRequest(path=path, size=len(data), if_absent=True), timeout=5, metadata=_md(ENGINE_A))
    dc = DataClient(ENGINE_A)
    try:
        crc, lp = dc.write(a.worker.data_address, a.block_id, path, memoryview(data), 0, time.monotonic() + 5,
                           cap=a.worker.capability)
    finally:
        dc.close()
    assert crc == crc32c.crc32c(data)
    req = pb.CommitRequest(path=path, block_id=a.block_id, worker_id=a.worker.worker_id, size=len(data), crc32c=crc,
                           if_absent=True, local_path=lp)
    wrong = [(ENGINE_B, pb.CommitRequest(path=f"{B}/took", block_id=a.block_id, worker_id=a.worker.worker_id,
                                         size=len(data), crc32c=crc, if_absent=True)),
             (ADMIN, pb.CommitRequest(path=path, block_id=a.block_id, worker_id=a.worker.worker_id, size=len(data),
                                      crc32c=crc, if_absent=True)),
             (ENGINE_A, pb.CommitRequest(path=f"{A}/elsewhere", block_id=a.block_id, worker_id=a.worker.worker_id,
                                         size=len(data), crc32c=crc, if_absent=True)),
             (ENGINE_A, pb.CommitRequest(path=path, block_id="0" * 32, worker_id=a.worker.worker_id,
                                         size=len(data), crc32c=crc, if_absent=True))]
    for token, r in wrong:
        with pytest.raises(grpc.RpcError) as e:
            m.Commit(r, timeout=5, metadata=_md(token))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (token, r.path)
    assert m.Commit(req, timeout=5, metadata=_md(ENGINE_A)).published
    assert m.Commit(req, timeout=5, metadata=_md(ENGINE_A)).published  # a retried commit of our own block
    with cl.client(token=ADMIN, timeout=DEADLINE) as admin:
        assert admin.get(path) == data
        assert admin.stat(f"{B}/took") is None and admin.stat(f"{A}/elsewhere") is None


# ---------- 2. the writer's checksum, not the worker's ----------

@contextlib.contextmanager
def _evil_worker(cl: Any, tmp_path: Path, mode: str, sock: str) -> Iterator[dict]:
    """A real worker process of node "node-evil" whose store alters every block (reliability_evil_worker)."""
    port_file = tmp_path / f"evil-{mode}.port"
    log = tmp_path / f"evil-{mode}.log"
    args = [sys.executable, str(EVIL), mode, "--master", cl.master, "--host", "127.0.0.1", "--port", "0",
            "--data-dir", f"{tmp_path / ('evil-' + mode)}:256M", "--node-id", "node-evil", "--heartbeat-interval",
            "1", *(["--token", cl.token] if cl.token else []), "--domain-socket", sock, "--port-file", str(port_file)]
    env = {k: v for k, v in os.environ.items() if k != "L2FS_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EVIL.parent), env.get("PYTHONPATH", "")) if p)
    proc = procs.spawn(args, log, env=env)
    try:
        info = procs.wait_ready(proc, procs.port_file(port_file), timeout=30, what="evil worker", log_path=log)
        cl.wait_workers(1, timeout=30)

        def ready() -> bool:
            try:
                with cl.client() as c:
                    c.put(f"/probe/{time.monotonic_ns()}", b"p")  # refused with NOT_READY until registered
            except L2fsError as e:
                return NOT_READY not in str(e)  # (an altered block's put fails: that worker is serving)
            return True

        _wait(ready, 20, "evil worker ready")
        yield info
    finally:
        procs.stop(proc)


def _clients(cl: Any, sock: str) -> dict[str, Client]:
    """The client write paths: data plane, gRPC stream, same-node through the fd socket."""
    return {"data-plane": cl.client(node_id="node-1", timeout=DEADLINE),
            "grpc": cl.client(node_id="node-1", timeout=DEADLINE, data_plane=False),
            "fd": cl.client(node_id="node-evil", timeout=DEADLINE)}


@pytest.mark.parametrize("mode", ["own-crc", "writer-crc"])
def test_trust_worker_that_alters_bytes_never_serves_them(make_cluster: Any, tmp_path: Path, mode: str) -> None:
    """A compromised worker stores every block with one byte flipped. Answering with the CRC32C of what it
    stored, before, it had those bytes published and sealed (the client committed the worker's CRC): a reader on
    another node got wrong bytes. Now the client commits the CRC32C of the bytes it sent, and a put whose
    worker answers otherwise fails: no path is published. Answering with the writer's CRC instead, the put is
    published and every read misses (the bytes do not match the committed CRC). Put, put_many, each write
    transport, fsspec."""
    import fsspec

    cl = make_cluster(workers=0)
    sock = f"/tmp/l2fs-evil-{os.getpid()}-{mode}.sock"
    with _evil_worker(cl, tmp_path, mode, sock):
        clients = _clients(cl, sock)
        reader = cl.client(node_id="node-reader", timeout=DEADLINE)
        try:
            wrote: dict[str, bytes] = {}
            outcomes: dict[str, Any] = {}
            for how, c in clients.items():
                p = f"/t/{how}/one"
                wrote[p] = payload(1, 50_000, how)
                many = [(f"/t/{how}/many{i}", payload(i, 20_000, how)) for i in range(3)]
                wrote.update(many)
                try:
                    outcomes[p] = c.put(p, wrote[p])
                except L2fsError as e:
                    outcomes[p] = e
                outcomes.update(zip([q for q, _ in many], c.put_many(many, return_exceptions=True), strict=True))
            fs = fsspec.filesystem("l2fs", master=cl.master, node_id="node-1", token=None)
            wrote["/t/fsspec/obj"] = b"f" * 30_000
            try:
                fs.pipe_file("/t/fsspec/obj", wrote["/t/fsspec/obj"])
                outcomes["/t/fsspec/obj"] = True
            except L2fsError as e:
                outcomes["/t/fsspec/obj"] = e
            served = {path: reader.get(path) for path in wrote}
            assert [p for p, got in served.items() if got is not None and got != wrote[p]] == [], "wrong bytes"
            assert [p for p, got in served.items() if got is not None] == []  # an altered block is never read
            if mode == "own-crc":  # the put failed and published nothing
                assert [p for p, r in outcomes.items() if not isinstance(r, L2fsError)] == [], outcomes
                assert [p for p in wrote if reader.stat(p) is not None] == []
            else:  # the worker's answer matched what was sent: published; its reads miss
                assert [p for p, r in outcomes.items() if r is not True] == [], outcomes
        finally:
            reader.close()
            for c in clients.values():
                c.close()


@pytest.mark.fuse
def test_trust_mount_writes_to_an_altering_worker_are_never_read_back(make_cluster: Any, tmp_path: Path) -> None:
    """The same compromised worker (own CRC) behind a FUSE mount (its writes go over the data plane): the
    write's close fails, nothing is published, and another node's read misses instead of returning the
    altered bytes."""
    from l2fs.fuse import mount_type, spawn

    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root")
    cl = make_cluster(workers=0)
    sock = f"/tmp/l2fs-evil-{os.getpid()}-mnt.sock"
    with _evil_worker(cl, tmp_path, "own-crc", sock):
        mp = tmp_path / "mnt"
        mp.mkdir()
        proc = spawn(mp, cl.master, "--node-id", "node-1", log=tmp_path / "mount.log", timeout=30)
        try:
            assert mount_type(mp) == "fuse.l2fs"
            (mp / "t").mkdir(exist_ok=True)
            with pytest.raises(OSError):
                with open(mp / "t" / "chunk", "wb") as f:
                    f.write(payload(7, 100_000, "mnt"))
            with cl.client(node_id="node-reader", timeout=DEADLINE) as reader:
                assert reader.get("/t/chunk") is None and reader.stat("/t/chunk") is None
        finally:
            procs.stop(proc)


# ---------- 4. capabilities carry the size ----------

def test_trust_write_capability_holds_the_writer_to_its_allocated_size(make_cluster: Any, tmp_path: Path) -> None:
    """Engine A allocates 1 byte (A's quota is 1 MiB) and sends 40 MiB with that capability: on the data plane
    and the gRPC stream (before: accepted, the reservation evicted B's chunks, 40 MiB sealed on the worker),
    and as a same-node reservation of 40 MiB. Now each is refused before a byte is reserved; B's 40 chunks all
    read back and the worker holds no more than before. The fd of a 1-byte same-node reservation takes at
    most that byte (before: 8 MiB went into the worker's disk, uncounted), and once the reservation expired
    the worker's disk holds nothing of it, whatever the client still holds."""
    sock = f"/tmp/l2fs-size-{os.getpid()}.sock"
    cl = _scoped(make_cluster, tmp_path, capacity="64M", master=["--prefix-quota", f"{A}=1M"],
                 worker=["--domain-socket", sock, "--reservation-ttl", "2"])
    mib = 1 << 20
    chunks = {f"{B}/c{i}": payload(i, mib, f"b{i}") for i in range(40)}
    with cl.client(token=ENGINE_B, timeout=10) as b:
        assert all(b.put_many(list(chunks.items())))
    with cl.client(token=ADMIN) as admin:  # what the worker holds (its heartbeat reports it)
        used0 = _wait(lambda: (u := admin.report().workers[0].used) >= 40 * mib and u, what="B's bytes reported")
    m = pbg.MasterStub(make_channel(cl.master, None))
    big = memoryview(os.urandom(40 * mib))

    def alloc(name: str) -> pb.AllocateResponse:
        return m.Allocate(pb.AllocateRequest(path=f"{A}/{name}", size=1, node_id="node-1", if_absent=True),
                          timeout=5, metadata=_md(ENGINE_A))

    refused: dict[str, Any] = {}
    a = alloc("dp")
    dc = DataClient(ENGINE_A)
    try:
        dc.write(a.worker.data_address, a.block_id, f"{A}/dp", big, 0, time.monotonic() + 30, cap=a.worker.capability)
        refused["data plane"] = False
    except DataPlaneError as e:
        refused["data plane"] = str(e)
    finally:
        dc.close()
    g = alloc("grpc")
    stub = pbg.WorkerStub(make_channel(g.worker.address, None))

    def frames() -> Iterator[pb.WriteChunk]:
        yield pb.WriteChunk(block_id=g.block_id, path=f"{A}/grpc", size=big.nbytes, data=bytes(big[:mib]),
                            capability=g.worker.capability)
        for off in range(mib, big.nbytes, mib):
            yield pb.WriteChunk(data=bytes(big[off:off + mib]))

    try:
        stub.WriteBlock(frames(), timeout=30, metadata=_md(ENGINE_A))
        refused["grpc"] = False
    except grpc.RpcError as e:
        refused["grpc"] = e.code()
    r = alloc("fd-big")
    try:
        stub.ReserveLocal(pb.ReserveRequest(block_id=r.block_id, size=big.nbytes, capability=r.worker.capability,
                                            path=f"{A}/fd-big"), timeout=5, metadata=_md(ENGINE_A))
        refused["reserve"] = False
    except grpc.RpcError as e:
        refused["reserve"] = e.code()
    with cl.client(token=ENGINE_B, timeout=10) as b:
        assert [b.get(p) == d for p, d in chunks.items()] == [True] * len(chunks)
    assert refused["data plane"] and "size" in str(refused["data plane"]), refused
    assert refused["grpc"] == refused["reserve"] == grpc.StatusCode.PERMISSION_DENIED, refused
    # a 1-byte same-node reservation: its fd takes that byte and no more
    f = alloc("fd")
    stub.ReserveLocal(pb.ReserveRequest(block_id=f.block_id, size=1, capability=f.worker.capability,
                                        path=f"{A}/fd"), timeout=5, metadata=_md(ENGINE_A))
    fd, _, _ = request_fd(sock, FD_WRITE, f.worker.capability, f.block_id, f"{A}/fd")
    try:
        wrote = 0
        with contextlib.suppress(OSError):
            chunk = b"x" * mib
            for _ in range(8):
                wrote += os.write(fd, chunk)
        assert wrote <= 1, f"{wrote} bytes went into a 1-byte reservation"
        tmp = cl.workers[0].data_dir / "tmp"  # the worker's temp files (unsealed writes)
        assert sum(p.stat().st_size for p in tmp.iterdir() if p.is_file()) <= 1
        time.sleep(4.0)  # past --reservation-ttl: the worker gives the reservation up (it sweeps every second)
        with contextlib.suppress(OSError):
            os.write(fd, b"y" * mib)
        assert [p.name for p in tmp.iterdir()] == []
    finally:
        os.close(fd)
    time.sleep(2.0)  # a heartbeat or two: the worker's used bytes as it counts them now
    with cl.client(token=ADMIN) as admin:
        used = admin.report().workers[0].used
    assert used <= used0 + mib, (used, used0)
    with cl.client(token=ADMIN, timeout=10) as admin:
        assert [admin.get(p) == d for p, d in chunks.items()] == [True] * len(chunks)
        for name in ("dp", "grpc", "fd-big", "fd"):
            assert admin.stat(f"{A}/{name}") is None

