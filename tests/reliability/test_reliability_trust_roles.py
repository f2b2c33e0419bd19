"""Scoped credentials: a tokens file gives each holder a role, and the master
and workers check the role per method before the request is read, and an engine's prefix where the path is.

Before this, clients and workers shared one token, so every vLLM pod holding it could register as a worker
(under a live worker's id: its files vanished and its next put was captured), delete, rename and overwrite
anything. Real master + worker processes; the client, the worker and raw gRPC stubs as the callers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from reliability_faults import DEADLINE, payload
from test_reliability_security import _code

from l2fs.client import PermissionDenied
from l2fs.common import capability
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

WORKER = "worker-token-0123456789"
WORKER_B = "worker-b-token-0123456789"  # another node's worker token
MASTER = "master-token-0123456789"  # the master's own worker-role token, to call workers with
ENGINE = "engine-token-0123456789"
ROUTER = "router-token-0123456789"
ADMIN = "admin-token-01234567890"
PREFIX = "/kvtier/kv/ep-a"
TOKENS = [
    {"name": "master", "token": MASTER, "role": "worker"},
    {"name": "worker-a", "token": WORKER, "role": "worker"},
    {"name": "worker-b", "token": WORKER_B, "role": "worker"},
    {"name": "engine-a", "token": ENGINE, "role": "engine", "prefixes": [PREFIX]},
    {"name": "router", "token": ROUTER, "role": "router"},
    {"name": "ops", "token": ADMIN, "role": "admin"},
]


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def roles_cluster(make_cluster: Any, tmp_path: Path) -> Any:
    """One master + one worker with the tokens file; the cluster's own clients (wait_workers) use ADMIN."""
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps(TOKENS))
    # extra args come after the cluster's --token ADMIN, so each process's own token wins
    return make_cluster(workers=1, token=ADMIN, master_args=["--tokens-file", str(f), "--token", MASTER],
                        worker_args=["--tokens-file", str(f), "--token", WORKER])


def test_worker_tokens_cannot_make_the_masters_calls_to_a_worker(roles_cluster: Any) -> None:
    """A worker's DeleteBlocks/SetPaths/SealBlocks took any worker-role token, so one worker could delete or
    repoint another's blocks. With a block key the worker now takes them only with the master's MAC for that
    exact request under its data key: its own token, another worker's, the admin's, a MAC of another key,
    another request's, or an expired one are refused and nothing changes; the master's own deletes still land."""
    admin = roles_cluster.client(token=ADMIN, timeout=DEADLINE)
    data = payload(2, 32 * 1024, f"{PREFIX}/keep")
    assert admin.put(f"{PREFIX}/keep", data) is True
    real = admin.report().workers[0]
    m = pbg.MasterStub(grpc.insecure_channel(roles_cluster.master))
    loc = m.Stat(pb.PathRequest(path=f"{PREFIX}/keep"), timeout=DEADLINE, metadata=_md(ADMIN)).locations[0]
    w = pbg.WorkerStub(grpc.insecure_channel(real.address))
    dreq = pb.BlockIds(block_ids=[loc.block_id])
    sreq = pb.SetPathsRequest(block_ids=[loc.block_id], paths=[f"{PREFIX}/moved"])
    kreq = pb.SealRequest(block_ids=[loc.block_id], crc32cs=[1], seals=["0" * 32])  # would drop it (CRC differs)
    assert roles_cluster.block_key_file is not None
    kw = capability.data_key(roles_cluster.block_key_file.read_bytes(), real.worker_id)
    soon, past = int(time.time() + 60), int(time.time() - 600)
    calls = {"DeleteBlocks": (w.DeleteBlocks, dreq), "SetPaths": (w.SetPaths, sreq), "SealBlocks": (w.SealBlocks, kreq)}
    for name, (call, req) in calls.items():
        body = req.SerializeToString()
        forged = [capability.master_call_mac(b"k" * 32, name, body, soon),  # another key
                  capability.master_call_mac(kw, name, pb.BlockIds(block_ids=["f" * 32]).SerializeToString(), soon),
                  capability.master_call_mac(kw, "Other", body, soon),  # another method
                  capability.master_call_mac(kw, name, body, past)]  # expired
        for token in (WORKER, WORKER_B, MASTER, ADMIN):
            assert _code(lambda c=call, r=req, t=token: c(r, timeout=DEADLINE, metadata=_md(t))) \
                == grpc.StatusCode.PERMISSION_DENIED, (name, token)
        for mac in forged:
            md = (*_md(WORKER_B), (capability.MASTER_MD, mac))
            assert _code(lambda c=call, r=req, md=md: c(r, timeout=DEADLINE, metadata=md)) \
                == grpc.StatusCode.PERMISSION_DENIED, (name, mac)
    assert admin.get(f"{PREFIX}/keep") == data
    assert m.Stat(pb.PathRequest(path=f"{PREFIX}/keep"), timeout=DEADLINE,
                  metadata=_md(ADMIN)).locations[0].block_id == loc.block_id
    # the master's own maintenance calls carry the MAC: a removed file's block leaves the worker
    gone = payload(3, 16 * 1024, f"{PREFIX}/gone")
    assert admin.put(f"{PREFIX}/gone", gone) is True
    gid = m.Stat(pb.PathRequest(path=f"{PREFIX}/gone"), timeout=DEADLINE, metadata=_md(ADMIN)).locations[0].block_id
    block = roles_cluster.workers[0].data_dir / "blocks" / gid[:2] / gid
    assert block.exists()
    admin.rm(f"{PREFIX}/gone")
    end = time.monotonic() + 15
    while block.exists() and time.monotonic() < end:
        time.sleep(0.1)
    assert not block.exists(), "the master's DeleteBlocks did not reach the worker"


def test_engine_cannot_impersonate_a_worker(roles_cluster: Any) -> None:
    """Finding 1: an engine token re-registering the live worker's id (pointing at its own address) or
    reporting its blocks is refused; the worker keeps its id, address and files. A worker token registers."""
    admin = roles_cluster.client(token=ADMIN, timeout=DEADLINE)
    data = payload(1, 64 * 1024, f"{PREFIX}/a")
    assert admin.put(f"{PREFIX}/a", data) is True
    real = admin.report().workers[0]
    m = pbg.MasterStub(grpc.insecure_channel(roles_cluster.master))
    hijack = pb.RegisterRequest(worker_id=real.worker_id, node_id=real.node_id, address="127.0.0.1:1",
                                capacity=1 << 30, blocks=[])
    for token in (ENGINE, ROUTER, ADMIN):
        assert _code(lambda t=token: m.RegisterWorker(hijack, timeout=DEADLINE, metadata=_md(t))) \
            == grpc.StatusCode.PERMISSION_DENIED, token
        assert _code(lambda t=token: m.Heartbeat(pb.HeartbeatRequest(worker_id=real.worker_id), timeout=DEADLINE,
                                                 metadata=_md(t))) == grpc.StatusCode.PERMISSION_DENIED, token
        assert _code(lambda t=token: m.RemoveBlocks(pb.BlocksRemoved(worker_id=real.worker_id),
                                                    timeout=DEADLINE, metadata=_md(t))) \
            == grpc.StatusCode.PERMISSION_DENIED, token
    w = pbg.WorkerStub(grpc.insecure_channel(real.address))
    loc = m.Stat(pb.PathRequest(path=f"{PREFIX}/a"), timeout=DEADLINE, metadata=_md(ADMIN)).locations[0]
    assert _code(lambda: w.DeleteBlocks(pb.BlockIds(block_ids=[loc.block_id]), timeout=DEADLINE,
                                        metadata=_md(ENGINE))) == grpc.StatusCode.PERMISSION_DENIED
    after = [x for x in admin.report().workers if x.worker_id == real.worker_id]
    assert after and after[0].address == real.address and after[0].alive
    assert admin.get(f"{PREFIX}/a") == data
    # another worker's token may not take over, heartbeat or report for the live worker's id either
    assert _code(lambda: m.RegisterWorker(hijack, timeout=DEADLINE, metadata=_md(WORKER_B))) \
        == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: m.Heartbeat(pb.HeartbeatRequest(worker_id=real.worker_id), timeout=DEADLINE,
                                     metadata=_md(WORKER_B))) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: m.RemoveBlocks(pb.BlocksRemoved(worker_id=real.worker_id, block_ids=[loc.block_id]),
                                        timeout=DEADLINE, metadata=_md(WORKER_B))) \
        == grpc.StatusCode.PERMISSION_DENIED
    after = [x for x in admin.report().workers if x.worker_id == real.worker_id]
    assert after and after[0].address == real.address and after[0].alive
    assert admin.get(f"{PREFIX}/a") == data
    # the owner itself re-registers its id at once after a kill -9 (still listed alive): same credential
    roles_cluster.kill_worker(0)
    roles_cluster.start_worker(0)
    assert admin.get(f"{PREFIX}/a") == data
    # a worker token registers (a new worker id; the real worker registered with its own token too)
    ok = pb.RegisterRequest(worker_id="extra-worker", node_id="node-9", address="127.0.0.1:2", capacity=1 << 20)
    assert _code(lambda: m.RegisterWorker(ok, timeout=DEADLINE, metadata=_md(WORKER))) == grpc.StatusCode.OK
    assert any(x.worker_id == "extra-worker" for x in admin.report().workers)


def test_engine_puts_if_absent_under_its_prefix_only(roles_cluster: Any) -> None:
    admin = roles_cluster.client(token=ADMIN, timeout=DEADLINE)
    eng = roles_cluster.client(token=ENGINE, timeout=DEADLINE, short_circuit=False)
    data, other = payload(2, 64 * 1024, "x"), payload(3, 64 * 1024, "y")
    eng.mkdir(PREFIX, parents=True, exist_ok=True)  # the connector creates its prefix (and its ancestors)
    assert eng.put(f"{PREFIX}/mine", data) is True  # through the data plane with the engine token
    assert eng.get(f"{PREFIX}/mine") == data
    assert eng.put(f"{PREFIX}/mine", other) is False  # put-if-absent: already there
    with pytest.raises(PermissionDenied):
        eng.put("/kvtier/kv/ep-b/theirs", data)  # another endpoint's prefix
    with pytest.raises(PermissionDenied):
        eng.put(f"{PREFIX}-evil/x", data)  # a sibling that merely starts with the same letters
    with pytest.raises(PermissionDenied):
        eng.put(f"{PREFIX}/mine", other, if_absent=False)  # overwrite
    with pytest.raises(PermissionDenied):
        eng.rm(f"{PREFIX}/mine")
    with pytest.raises(PermissionDenied):
        eng.rename(f"{PREFIX}/mine", f"{PREFIX}/moved")
    with pytest.raises(PermissionDenied):
        eng.mkdir("/elsewhere")
    assert admin.get(f"{PREFIX}/mine") == data
    assert not admin.exists("/kvtier/kv/ep-b/theirs") and not admin.exists(f"{PREFIX}-evil/x")
    assert not admin.exists(f"{PREFIX}/moved") and not admin.exists("/elsewhere")
    # a raw Commit naming a path outside the prefix is refused too (the path is checked where it is read)
    m = pbg.MasterStub(grpc.insecure_channel(roles_cluster.master))
    w = admin.report().workers[0]
    commit = pb.CommitRequest(path="/kvtier/kv/ep-b/x", block_id="a" * 32, worker_id=w.worker_id, size=1,
                              if_absent=True)
    assert _code(lambda: m.Commit(commit, timeout=DEADLINE, metadata=_md(ENGINE))) \
        == grpc.StatusCode.PERMISSION_DENIED


def test_router_reads_only_and_admin_may_delete(roles_cluster: Any) -> None:
    admin = roles_cluster.client(token=ADMIN, timeout=DEADLINE)
    router = roles_cluster.client(token=ROUTER, timeout=DEADLINE, short_circuit=False)
    data = payload(4, 64 * 1024, "r")
    assert admin.put(f"{PREFIX}/r", data) is True
    assert router.exists(f"{PREFIX}/r") and router.get(f"{PREFIX}/r") == data
    assert router.prefix_lookup([f"{PREFIX}/r", f"{PREFIX}/none"]) == 1
    with pytest.raises(PermissionDenied):
        router.put(f"{PREFIX}/by-router", data)
    with pytest.raises(PermissionDenied):
        router.rm(f"{PREFIX}/r")
    assert not admin.exists(f"{PREFIX}/by-router")
    # admin: overwrite, rename, rm
    assert admin.put(f"{PREFIX}/r", payload(5, 1024, "o"), if_absent=False) is True
    admin.rename(f"{PREFIX}/r", f"{PREFIX}/r2")
    assert admin.rm(f"{PREFIX}/r2") is True
    assert not router.exists(f"{PREFIX}/r2")


def test_unknown_token_is_unauthenticated(roles_cluster: Any) -> None:
    m = pbg.MasterStub(grpc.insecure_channel(roles_cluster.master))
    for md in (None, _md("not-a-token-at-all-000"), _md(ENGINE + "x")):
        assert _code(lambda x=md: m.Stat(pb.PathRequest(path="/a"), timeout=DEADLINE, metadata=x)) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda x=md: m.RegisterWorker(pb.RegisterRequest(worker_id="x"), timeout=DEADLINE,
                                                   metadata=x)) == grpc.StatusCode.UNAUTHENTICATED
    stranger = roles_cluster.client(token="not-a-token-at-all-000", timeout=DEADLINE, short_circuit=False)
    with pytest.raises(PermissionDenied):
        stranger.exists("/a")


@pytest.mark.parametrize("content,why", [
    ("{not json", "tokens file"),
    (json.dumps([]), "non-empty"),
    (json.dumps([{"name": "x", "token": "short", "role": "admin"}]), "at least 16"),
    (json.dumps([{"name": "x", "token": ADMIN, "role": "root"}]), "role must be one of"),
    (json.dumps([{"name": "x", "token": ENGINE, "role": "engine"}]), "needs at least one prefix"),
    (json.dumps([{"name": "x", "token": ADMIN, "role": "admin", "extra": 1}]), "want an object"),
    (json.dumps([{"token": ADMIN, "role": "admin"}, {"token": ADMIN, "role": "router"}]), "duplicate token"),
    (json.dumps([{"name": "a", "token": ADMIN, "role": "admin"}, {"name": "a", "token": ROUTER, "role": "router"}]),
     "duplicate name"),
])
def test_bad_tokens_file_exits_2(tmp_path: Path, content: str, why: str) -> None:
    f = tmp_path / "tokens.json"
    f.write_text(content)
    for argv in (["master", "--port", "0"], ["worker", "--master", "127.0.0.1:1", "--node-id", "n",
                                             "--data-dir", f"{tmp_path}/d:1M", "--port", "0"]):
        r = subprocess.run([sys.executable, "-m", "l2fs.cli", *argv, "--tokens-file", str(f)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (argv[0], r.stdout, r.stderr)
        assert why in r.stderr, (argv[0], r.stderr)
