"""Trust as deployed, per-source and per-credential limits, against real master/worker processes on loopback.

- TokenReview per source: one address flooding made-up bearer tokens takes at most its own share of the
  unknown-token review budget (l2fs/master/identity.py SOURCE_*), so a new node's worker from another address
  is still reviewed. Before, one shared budget (20/s) served every stranger: the flood kept it empty and new
  workers' reviews were shed for as long as it lasted.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from reliability_faults import DEADLINE, payload

from l2fs.client import L2fsError
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from operator_helpers import SA, jwt, review_api  # noqa: E402
from test_operator_review_flood import _flood  # noqa: E402
from test_operator_worker_identity import k8s_local_cluster  # noqa: E402

FLOOD_SOURCE = "127.0.0.2"  # another loopback address: the master sees the flood from it, the rest from 127.0.0.1


@contextlib.contextmanager
def _forwarder(target: str, source: str) -> Iterator[str]:
    """A TCP forwarder on 127.0.0.1 whose connections reach `target` from the address `source` (gRPC's
    client cannot choose its source address): what the master sees as the caller's address."""
    host, _, port = target.rpartition(":")
    lst = socket.create_server(("127.0.0.1", 0))
    lst.settimeout(0.2)
    stop = threading.Event()

    def pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := a.recv(1 << 16):
                b.sendall(chunk)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = lst.accept()
            except (TimeoutError, OSError):
                continue
            up = socket.create_connection((host, int(port)), source_address=(source, 0))
            conn.settimeout(None)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{lst.getsockname()[1]}"
    finally:
        stop.set()
        t.join(timeout=5)
        lst.close()


@pytest.mark.k8s
def test_one_source_flooding_made_up_tokens_leaves_other_sources_reviewed(tmp_path: Path, make_cluster: Any) -> None:
    """4 threads of made-up-token Heartbeats from 127.0.0.2 (through a forwarder) on a `--worker-identity k8s`
    master (kmock TokenReview); after 1.5 s of it, 8 new nodes' workers each present a real projected token
    from 127.0.0.1. Each is reviewed and accepted (its Heartbeat is answered, not UNAUTHENTICATED), within 3
    tries 0.3 s apart; the flood's reviews that reached the API server stay within that source's share (burst
    20 + 5/s). Before: the flood kept the one shared budget empty, 0 of the 8 got through."""
    with review_api(tmp_path) as api, k8s_local_cluster(make_cluster, api, tmp_path) as cl:
        new = {f"node-new-{i}": jwt(f"node-new-{i}") for i in range(8)}
        for node, tok in new.items():
            api.emu.table[tok] = (SA, node, ["l2fs"])
        seen0 = len(api.emu.seen)
        stop = threading.Event()
        counts = [0] * 4
        with _forwarder(cl.master, FLOOD_SOURCE) as via:
            threads = [threading.Thread(target=_flood, args=(via, stop, counts, k), daemon=True) for k in range(4)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            outcome: dict[str, list[str]] = {}
            try:
                time.sleep(1.5)  # the shared budget's burst (100) is long gone at the flood's rate
                stub = pbg.MasterStub(grpc.insecure_channel(cl.master))
                for node, tok in new.items():
                    tries = outcome[node] = []
                    for _ in range(3):
                        try:
                            stub.Heartbeat(pb.HeartbeatRequest(worker_id=node), timeout=5,
                                           metadata=(("authorization", f"Bearer {tok}"),))
                            tries.append("OK")
                        except grpc.RpcError as e:
                            tries.append(e.code().name)
                        if tries[-1] != "UNAUTHENTICATED":
                            break
                        time.sleep(0.3)
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=10)
            took = time.monotonic() - t0
        flood = sum(counts)
        assert flood / took > 100, f"the flood reached only {flood / took:.0f} calls/s"
        shed = {n: tries for n, tries in outcome.items() if tries[-1] == "UNAUTHENTICATED"}
        assert not shed, f"{len(shed)} of {len(new)} new workers' tokens not reviewed during the flood: {shed}"
        issued = {*new.values(), *(f.read_text() for f in cl.token_files.values())}
        strangers = sum(t not in issued for t in api.emu.seen[seen0:])
        assert strangers <= 20 + 5 * took + 2, f"{strangers} made-up tokens reviewed from one source in {took:.1f} s"


def test_mkdir_cap_per_credential_holds_and_loses_nothing(make_cluster: Any, tmp_path: Path) -> None:
    """A master with --max-dirs-per-credential 50 (65,536 by default; the same check): engine A's Mkdirs count
    up to exactly 50 directories; a Mkdir(parents) that would pass it is refused whole (RESOURCE_EXHAUSTED
    naming the credential, what it holds and the cap; none of its directories made), as is a 51st; A's stored
    files all read back and A still puts files into its directories; engine B and the admin make theirs as
    before."""
    from test_reliability_trust_deployed import ADMIN, ENGINE_A, ENGINE_B, A, B, _scoped

    cl = _scoped(make_cluster, tmp_path, master=["--max-dirs-per-credential", "50"])
    stored = {f"{A}/files/f{i}": payload(i, 10_000, "a") for i in range(4)}
    with cl.client(token=ENGINE_A, timeout=DEADLINE) as a, cl.client(token=ENGINE_B, timeout=DEADLINE) as b, \
            cl.client(token=ADMIN, timeout=DEADLINE) as admin:
        assert all(a.put_many(list(stored.items())))
        for i in range(40):
            a.mkdir(f"{A}/d{i}")
        deep = f"{A}/x/" + "/".join(f"y{i}" for i in range(14))  # 15 new directories: 55 > 50
        with pytest.raises(L2fsError) as e:
            a.mkdir(deep)
        msg = str(e.value)
        assert "engine-ep-a" in msg and "holds 40 directories" in msg and "at most 50" in msg, msg
        assert admin.stat(f"{A}/x") is None
        for i in range(40, 50):
            a.mkdir(f"{A}/d{i}")
        with pytest.raises(L2fsError, match="at most 50"):
            a.mkdir(f"{A}/d50")
        a.mkdir(f"{A}/d3")  # one it holds already: exist_ok, nothing new
        assert [a.get(p) == d for p, d in stored.items()] == [True] * len(stored)
        assert a.put(f"{A}/d7/chunk", b"k" * 1000) is True and admin.get(f"{A}/d7/chunk") == b"k" * 1000
        assert len([e for e in admin.ls(A) if e.path.rsplit("/", 1)[1].startswith("d")]) == 50
        for i in range(40):
            b.mkdir(f"{B}/d{i}")  # another credential: its own count (its first also makes B's prefix dir)
        admin.mkdir("/ops/" + "/".join(f"z{i}" for i in range(60)))  # admins are not counted


def _stat_as(cl: Any, path: str, token: str) -> pb.Location:
    m = pbg.MasterStub(grpc.insecure_channel(cl.master))
    return m.Stat(pb.PathRequest(path=path), timeout=10, metadata=(("authorization", f"Bearer {token}"),)).locations[0]


def test_data_plane_one_credential_from_many_addresses_holds_at_most_half_the_slots(make_cluster: Any,
                                                                                     tmp_path: Path) -> None:
    """A worker with 8 data-plane slots; engine A opens 8 connections from 3 addresses (127.0.0.2-4, none
    over its per-address half), each a valid read left open: the 5th and later are answered BUSY naming the
    per-credential limit (A's capabilities name A: c2), and engine B at a fifth address is served meanwhile.
    Before: capabilities named no credential, all 8 of A's were served and B was answered BUSY."""
    from test_reliability_bounds import _read_header
    from test_reliability_trust_deployed import ADMIN, ENGINE_A, ENGINE_B, A, B, _scoped

    cl = _scoped(make_cluster, tmp_path, capacity="64M", worker=["--data-max-conns", "8"])
    # written by the admin: its pooled connection (127.0.0.1, its own holder) counts against neither share
    with cl.client(token=ADMIN, timeout=DEADLINE) as admin:
        assert admin.put(f"{A}/x", b"a" * 10_000) is True and admin.put(f"{B}/x", b"b" * 10_000) is True
    la, lb = _stat_as(cl, f"{A}/x", ENGINE_A), _stat_as(cl, f"{B}/x", ENGINE_B)
    assert la.capability.startswith("c2.") and lb.capability.startswith("c2."), (la.capability, lb.capability)
    host, port = la.data_address.rsplit(":", 1)
    socks, statuses = [], []

    def connect(source: str, head: bytes) -> tuple[int, str]:
        s = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
        socks.append(s)
        s.sendall(head)
        st = s.recv(1, socket.MSG_WAITALL)[0]
        if st == 0:
            size, _ = struct.unpack("<QI", s.recv(12, socket.MSG_WAITALL))
            s.recv(size, socket.MSG_WAITALL)
            return st, ""
        (n,) = struct.unpack("<H", s.recv(2, socket.MSG_WAITALL))
        return st, s.recv(n, socket.MSG_WAITALL).decode()

    try:
        for k in range(8):
            statuses.append(connect(f"127.0.0.{2 + k % 3}", _read_header(la.capability, la.block_id)))
        other = connect("127.0.0.5", _read_header(lb.capability, lb.block_id))
    finally:
        for s in socks:
            s.close()
    assert [st for st, _ in statuses] == [0] * 4 + [4] * 4, statuses
    assert all("for one credential" in msg for _, msg in statuses[4:]), statuses
    assert other == (0, ""), f"engine B at another address was answered {other} (4 = BUSY)"


def test_block_streams_of_one_credential_from_many_addresses_leave_others_served(make_cluster: Any,
                                                                                tmp_path: Path) -> None:
    """24 unread ReadBlock streams (the worker admits 24 at once, 16 per address and, now, per credential) of a
    64 MiB block by engine A, 8 from each of 3 addresses (through forwarders): 16 are admitted and the rest
    refused RESOURCE_EXHAUSTED naming the credential, and engine B's stream is served meanwhile. Before: A's
    24 held every stream slot (none over its per-address 16) and B was refused."""
    from test_reliability_trust_deployed import ENGINE_A, ENGINE_B, A, B, _scoped

    cl = _scoped(make_cluster, tmp_path, capacity="256M")
    with cl.client(token=ENGINE_A, timeout=30) as a, cl.client(token=ENGINE_B, timeout=DEADLINE) as b:
        assert a.put(f"{A}/big", os.urandom(64 << 20)) is True and b.put(f"{B}/x", b"b" * 100_000) is True
    la, lb = _stat_as(cl, f"{A}/big", ENGINE_A), _stat_as(cl, f"{B}/x", ENGINE_B)
    md_a, md_b = (("authorization", f"Bearer {ENGINE_A}"),), (("authorization", f"Bearer {ENGINE_B}"),)
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 16 << 20)]
    chans: list[grpc.Channel] = []
    streams: list[Any] = []
    admitted: list[str] = []
    with contextlib.ExitStack() as stack:
        vias = [stack.enter_context(_forwarder(la.address, f"127.0.0.{2 + i}")) for i in range(3)]
        try:
            for k in range(24):
                ch = grpc.insecure_channel(vias[k % 3], options=opts)
                chans.append(ch)
                st = pbg.WorkerStub(ch).ReadBlock(pb.ReadRequest(block_id=la.block_id, capability=la.capability),
                                                  timeout=60, metadata=md_a)
                streams.append(st)
                try:
                    next(st)  # its first chunk: admitted (and then left unread)
                    admitted.append("OK")
                except grpc.RpcError as e:
                    admitted.append(f"{e.code().name}: {e.details()}")
            ch = grpc.insecure_channel(la.address, options=opts)
            chans.append(ch)
            got = b"".join(c.data for c in pbg.WorkerStub(ch).ReadBlock(
                pb.ReadRequest(block_id=lb.block_id, capability=lb.capability), timeout=30, metadata=md_b))
        finally:
            for s in streams:
                s.cancel()
            for ch in chans:
                ch.close()
    # (a stream of the first 16 can end early, buffered whole on the way: then a later one takes its place)
    assert admitted[:16] == ["OK"] * 16, admitted
    refused = [a for a in admitted[16:] if a != "OK"]
    assert len(refused) >= 4 and all(a.startswith("RESOURCE_EXHAUSTED") and "of this credential" in a
                                     for a in refused), admitted
    assert got == b"b" * 100_000


@pytest.mark.unit
def test_holder_is_bound_into_the_capability() -> None:
    """A c2 capability verifies only with the holder it was minted for: one rewritten to name another
    credential (to dodge that credential's count) fails; c1 capabilities still verify and name no holder."""
    from l2fs.common import capability as cp

    key, bid = b"k" * 32, "ab" * 16
    exp = int(time.time()) + 60
    mine, other = cp.holder_id("engine-ep-a"), cp.holder_id("engine-ep-b")
    r = cp.mint(key, cp.READ, bid, exp, holder=mine)
    w = cp.mint(key, cp.WRITE, bid, exp, "/p", 10, holder=mine)
    assert r.startswith("c2.") and cp.holder_of(r) == mine and cp.expiry_of(r) == exp
    assert cp.why_denied(key, r, cp.READ, bid) is None
    assert cp.why_denied(key, w, cp.WRITE, bid, "/p", size=10) is None
    assert cp.why_denied(key, w, cp.WRITE, bid, "/p", size=11) is not None
    assert cp.why_denied(key, r.replace(mine, other), cp.READ, bid) is not None
    old = cp.mint(key, cp.READ, bid, exp)
    assert old.startswith("c1.") and cp.holder_of(old) is None and cp.why_denied(key, old, cp.READ, bid) is None
