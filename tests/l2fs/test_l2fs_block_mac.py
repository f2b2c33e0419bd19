"""Worker trust: blocks the master never allocated are never published, and a worker id is bound to
its node's credential across a master restart.

With `--block-key-file` (LocalCluster's default) the master mints every block id as its own MAC over (worker
id, size) (l2fs.common.BlockKey). Before, a worker-role credential could report made-up blocks (or another
worker's, or a resized one) under any path and the master published them, and a Commit believed the client's
worker id and size; after a master restart, the in-memory owner binding was empty, so any worker credential
could take a live worker's id. Real master and worker processes; raw gRPC stubs play the attacker.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import grpc
import pytest
from l2fs_helpers import wait_until

from l2fs.common import BlockKey, BlockKeyError, Credential, TokensFileError, load_block_key, load_tokens_file
from l2fs.common import ensure_block_key as make_key
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.testing.cluster import LocalCluster

MASTER = "master-token-0123456789"
WORKER_A = "worker-a-token-0123456789"  # node-1: the real worker's credential
WORKER_B = "worker-b-token-0123456789"  # node-2: a legitimate worker credential of another node, the attacker
ENGINE = "engine-token-0123456789"
ADMIN = "admin-token-01234567890"
PREFIX = "/kvtier/kv/ep"
TOKENS = [
    {"name": "master", "token": MASTER, "role": "worker"},
    {"name": "worker-node-1", "token": WORKER_A, "role": "worker", "node": "node-1"},
    {"name": "worker-node-2", "token": WORKER_B, "role": "worker", "node": "node-2"},
    {"name": "engine-ep", "token": ENGINE, "role": "engine", "prefixes": [PREFIX]},
    {"name": "ops", "token": ADMIN, "role": "admin"},
]
T = 10.0  # RPC deadline


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _code(fn: object) -> grpc.StatusCode:
    try:
        fn()  # type: ignore[operator]
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.fixture
def keyed(tmp_path: Path, make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    """One real worker (node-1, its own node-bound credential) and a master with a block key and the tokens
    file; the cluster's own clients use ADMIN."""
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps(TOKENS))
    c = make_cluster(1, capacity="256M", heartbeat_timeout=20, token=ADMIN,
                     master_args=["--tokens-file", str(f), "--token", MASTER],
                     worker_args=["--tokens-file", str(f), "--token", WORKER_A])
    assert c.block_key_file is not None and c.block_key_file.exists()
    return c


def _master(c: LocalCluster) -> pbg.MasterStub:
    return pbg.MasterStub(grpc.insecure_channel(c.master))


def _mac_rejects(c: LocalCluster) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{c.master_metrics_port}/metrics", timeout=T).read().decode()
    lines = [x for x in text.splitlines() if x.startswith('l2fs_master_report_rejects_total{reason="mac"}')]
    return float(lines[0].split()[-1]) if lines else 0.0


def _register_attacker(c: LocalCluster, blocks: list[pb.BlockReport]) -> pb.RegisterResponse:
    """worker-node-2's credential registers as itself (legitimately: its node, its id) and reports `blocks`."""
    return _master(c).RegisterWorker(pb.RegisterRequest(
        worker_id="node-2@evil", node_id="node-2", address="127.0.0.1:1", capacity=1 << 30, blocks=blocks),
        timeout=T, metadata=_md(WORKER_B))


def test_unallocated_reported_blocks_are_never_published(keyed: LocalCluster) -> None:
    """A worker credential reporting a made-up block id (over a live file, newer mtime, and on a fresh path),
    the real worker's block id under its own worker id, and one of its own allocated ids with another size:
    none is published, the live file is neither displaced nor deleted, and after a master restart (same key)
    the real worker's blocks are published again and read back byte-identical, the attacker's still not."""
    admin = keyed.client(timeout=T)
    data = {f"{PREFIX}/real{i}": secrets.token_bytes(20_000 + i) for i in range(3)}
    for p, d in data.items():
        assert admin.put(p, d) is True
    real = admin.stat(f"{PREFIX}/real0")
    assert real is not None
    real_loc = _master(keyed).Stat(pb.PathRequest(path=f"{PREFIX}/real0"), timeout=T, metadata=_md(ADMIN)).locations[0]
    _register_attacker(keyed, [])
    # one id a master did mint for the attacker's worker (size 10), to report with another size
    own = _master(keyed).Allocate(pb.AllocateRequest(path=f"{PREFIX}/own", size=10, exclude_workers=[real_loc.worker_id]),
                                  timeout=T, metadata=_md(ADMIN))
    assert own.worker.worker_id == "node-2@evil"
    forged = [
        pb.BlockReport(block_id=secrets.token_hex(16), path=f"{PREFIX}/real0", size=5, mtime=4e9),  # displace
        pb.BlockReport(block_id=secrets.token_hex(16), path=f"{PREFIX}/fresh", size=5, mtime=4e9),
        pb.BlockReport(block_id=real_loc.block_id, path=f"{PREFIX}/stolen", size=real.size, mtime=4e9),
        pb.BlockReport(block_id=own.block_id, path=f"{PREFIX}/own", size=20, mtime=4e9),
    ]
    before = _mac_rejects(keyed)

    def check_not_published() -> None:
        for p in (f"{PREFIX}/fresh", f"{PREFIX}/stolen", f"{PREFIX}/own"):
            assert admin.stat(p) is None, p
            assert admin.get(p) is None, p
        st = admin.stat(f"{PREFIX}/real0")
        assert st is not None and st.size == real.size
        for p, d in data.items():
            assert admin.get(p) == d, p

    resp = _register_attacker(keyed, forged)
    check_not_published()
    assert not set(resp.delete_blocks) & {b.block_id for b in forged}  # unpublished, not deleted
    assert _mac_rejects(keyed) - before == len(forged)
    # the same report as a continuation of that registration
    _master(keyed).RegisterWorker(pb.RegisterRequest(
        worker_id="node-2@evil", node_id="node-2", address="127.0.0.1:1", capacity=1 << 30, blocks=forged,
        continuation=True), timeout=T, metadata=_md(WORKER_B))
    check_not_published()
    # master restart, same key: the real worker re-registers and its blocks (minted before) verify again
    keyed.kill_master()
    keyed.start_master()
    _register_attacker(keyed, forged)
    wait_until(lambda: all(admin.stat(p) is not None for p in data), timeout=30)
    check_not_published()
    st = _master(keyed).Stat(pb.PathRequest(path=f"{PREFIX}/real0"), timeout=T, metadata=_md(ADMIN))
    assert st.locations[0].block_id == real_loc.block_id  # not displaced by the forgery


def test_commit_must_name_the_allocated_worker_and_size(keyed: LocalCluster) -> None:
    """A minted id committed under another worker id, with another size, or a made-up id: refused with
    PERMISSION_DENIED (also inside CommitMany), nothing published; a put with the real values still works."""
    _register_attacker(keyed, [])
    eng = pbg.MasterStub(grpc.insecure_channel(keyed.master))
    real_id = keyed.workers[0].worker_id
    a = eng.Allocate(pb.AllocateRequest(path=f"{PREFIX}/c", size=100, if_absent=True, exclude_workers=["node-2@evil"]),
                     timeout=T, metadata=_md(ENGINE))
    assert a.worker.worker_id == real_id and len(a.block_id) == 32
    bad = [pb.CommitRequest(path=f"{PREFIX}/c", block_id=a.block_id, worker_id="node-2@evil", size=100, if_absent=True),
           pb.CommitRequest(path=f"{PREFIX}/c", block_id=a.block_id, worker_id=real_id, size=101, if_absent=True),
           pb.CommitRequest(path=f"{PREFIX}/c", block_id=secrets.token_hex(16), worker_id=real_id, size=100,
                            if_absent=True)]
    for token in (ENGINE, ADMIN):
        for r in bad:
            try:
                eng.Commit(r, timeout=T, metadata=_md(token))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "MAC" in (e.details() or ""), r
            else:
                raise AssertionError(f"commit {r} accepted")
        many = eng.CommitMany(pb.CommitManyRequest(items=bad), timeout=T, metadata=_md(token))
        assert [i.HasField("error") for i in many.items] == [True] * len(bad)
    admin = keyed.client(timeout=T)
    assert admin.stat(f"{PREFIX}/c") is None
    assert admin.put(f"{PREFIX}/c", b"x" * 100) is True and admin.get(f"{PREFIX}/c") == b"x" * 100


def test_node_bound_worker_id_survives_master_restart(keyed: LocalCluster) -> None:
    """After a master restart, while the real worker (node-1) has not re-registered yet, node-2's worker
    credential may not register the victim's worker id (with either node id) nor heartbeat for it; node-2
    may register its own; node-1's credential (the real worker) takes its id back and serves its data."""
    admin = keyed.client(timeout=T)
    d = secrets.token_bytes(30_000)
    assert admin.put(f"{PREFIX}/v", d) is True
    victim = keyed.workers[0]
    assert victim.proc is not None
    bid = _master(keyed).Stat(pb.PathRequest(path=f"{PREFIX}/v"), timeout=T, metadata=_md(ADMIN)).locations[0].block_id
    with closing(sqlite3.connect(victim.data_dir / "manifest.sqlite3")) as db:  # its seal reached the worker
        wait_until(lambda: db.execute("SELECT seal FROM blocks WHERE block_id=?", (bid,)).fetchone()[0], timeout=15)
    keyed.kill_master()
    os.kill(victim.proc.pid, signal.SIGSTOP)  # it cannot re-register before the attacker tries
    try:
        keyed.start_master()
        m = _master(keyed)
        for node in ("node-2", "node-1"):
            hijack = pb.RegisterRequest(worker_id=victim.worker_id, node_id=node, address="127.0.0.1:1",
                                        capacity=1 << 30)
            assert _code(lambda h=hijack: m.RegisterWorker(h, timeout=T, metadata=_md(WORKER_B))) \
                == grpc.StatusCode.PERMISSION_DENIED, node
        assert _code(lambda: m.Heartbeat(pb.HeartbeatRequest(worker_id=victim.worker_id), timeout=T,
                                         metadata=_md(WORKER_B))) == grpc.StatusCode.PERMISSION_DENIED
        # a worker id of node-2 under node-1's node id, or node-1's credential as node-2: refused too
        assert _code(lambda: m.RegisterWorker(pb.RegisterRequest(worker_id="node-2@x", node_id="node-1",
                                                                 address="127.0.0.1:1", capacity=1), timeout=T,
                                              metadata=_md(WORKER_B))) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: m.RegisterWorker(pb.RegisterRequest(worker_id="node-2@y", node_id="node-2",
                                                                 address="127.0.0.1:1", capacity=1), timeout=T,
                                              metadata=_md(WORKER_A))) == grpc.StatusCode.PERMISSION_DENIED
        assert not [w for w in admin.report().workers if w.worker_id == victim.worker_id]
        assert _code(lambda: m.RegisterWorker(pb.RegisterRequest(worker_id="node-2@own", node_id="node-2",
                                                                 address="127.0.0.1:1", capacity=1), timeout=T,
                                              metadata=_md(WORKER_B))) == grpc.StatusCode.OK
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    keyed.wait_workers(ids=[victim.worker_id])
    wait_until(lambda: admin.get(f"{PREFIX}/v") == d, timeout=30)


def test_bad_block_key_file_exits_2(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31)
    for path, why in ((short, "at least 32"), (tmp_path / "missing", "No such file")):
        r = subprocess.run([sys.executable, "-m", "l2fs.cli", "master", "--port", "0", "--block-key-file", str(path)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "block key file" in r.stderr and why in r.stderr, r.stderr


@pytest.mark.unit
def test_block_key_mint_and_verify(tmp_path: Path) -> None:
    key = BlockKey(b"k" * 32)
    bid = key.mint("node-1-abcd", 4096)
    assert len(bid) == 32 and bid == bid.lower() and int(bid, 16) >= 0
    assert key.verify(bid, "node-1-abcd", 4096)
    assert not key.verify(bid, "node-1-abcd", 4097)  # another size
    assert not key.verify(bid, "node-2-abcd", 4096)  # another worker
    assert not BlockKey(b"j" * 32).verify(bid, "node-1-abcd", 4096)  # another key
    flipped = bid[:5] + ("0" if bid[5] != "0" else "1") + bid[6:]
    assert not key.verify(flipped, "node-1-abcd", 4096)  # the random half is covered too
    assert not key.verify(bid.upper(), "node-1-abcd", 4096) and not key.verify("", "w", 0)
    assert key.mint("w", 1) != key.mint("w", 1)  # fresh randomness per id
    with pytest.raises(BlockKeyError):
        BlockKey(b"short")
    # key files: made once (0600), kept when they exist, refused when short
    f = make_key(tmp_path / "k")
    assert f.stat().st_mode & 0o077 == 0 and len(load_block_key(str(f))) >= 32
    first = f.read_bytes()
    assert make_key(f).read_bytes() == first
    (tmp_path / "s").write_bytes(b"1" * 31)
    with pytest.raises(BlockKeyError, match="at least 32"):
        load_block_key(str(tmp_path / "s"))


@pytest.mark.unit
def test_tokens_file_node_binding(tmp_path: Path) -> None:
    def load(entries: list[dict]) -> list[tuple[str, Credential]]:
        f = tmp_path / "t.json"
        f.write_text(json.dumps(entries))
        return load_tokens_file(str(f))

    (_, cred), = load([{"name": "w", "token": WORKER_A, "role": "worker", "node": "node-1"}])
    assert cred.node == "node-1"
    assert cred.may_be_worker("node-1", "node-1") and cred.may_be_worker("node-1@1234abcd", "node-1")
    assert cred.may_be_worker("node-1@1234abcd")  # heartbeats carry no node id: the worker id alone
    assert not cred.may_be_worker("node-1@1234abcd", "node-2")
    assert not cred.may_be_worker("node-10@1234abcd", "node-1")  # a node whose name merely starts the same
    assert not cred.may_be_worker("node-2@1234abcd", "node-1") and not cred.may_be_worker("xnode-1", "node-1")
    # exact: node-1's credential takes none of node-1-gpu's ids, nor the older "<node>-<hex>" form
    assert not cred.may_be_worker("node-1-gpu", "node-1") and not cred.may_be_worker("node-1-gpu@1234abcd")
    assert not cred.may_be_worker("node-1-1234abcd", "node-1")
    (_, free), = load([{"name": "w", "token": WORKER_A, "role": "worker"}])
    assert free.node == "" and free.may_be_worker("anything", "anywhere")  # no node: the weaker binding
    for bad in ({"role": "engine", "prefixes": ["/p"], "node": "n"}, {"role": "worker", "node": ""},
                {"role": "worker", "node": "a b"}, {"role": "worker", "node": 3}, {"role": "admin", "node": "n"},
                {"role": "worker", "node": "node-1@x"}):
        with pytest.raises(TokensFileError, match="node"):
            load([{"name": "x", "token": WORKER_B, **bad}])
