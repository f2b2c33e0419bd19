"""Node-bound worker identity: workers prove who they are with a projected ServiceAccount
token that the master checks with a TokenReview; the node the review names binds the worker ids the caller
may register, heartbeat and report for (l2fs/master/identity.py).

A real `l2fs master --worker-identity k8s` whose kubeconfig points at a kmock API emulator that answers
POST /apis/authentication.k8s.io/v1/tokenreviews from a table, as the API server would for tokens it
issued; real `l2fs worker` processes present "projected" tokens from files (--token-file, re-read per call)
and hold only the verifier file (token digests), not the tokens file. The attacks are raw gRPC calls with
another node's token.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from operator_helpers import SA, ReviewApi, jwt, review_api
from polling import wait_until

from l2fs.common import token_digest
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

pytestmark = pytest.mark.k8s

MASTER = "master-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ReviewApi]:
    with review_api(tmp_path) as handle:
        yield handle


def _call(method: Any, request: Any, token: str) -> grpc.StatusCode:
    """Status of one raw call with `token` as the bearer token (OK when it succeeded)."""
    try:
        method(request, timeout=10, metadata=(("authorization", f"Bearer {token}"),))
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@pytest.fixture
def k8s_cluster(api: ReviewApi, tmp_path: Path, make_cluster: Callable[..., Any]) -> Iterator[Any]:
    """Master with --worker-identity k8s + two workers (node-1, node-2), each with its own token file and the
    verifier file only."""
    with k8s_local_cluster(make_cluster, api, tmp_path) as cluster:
        yield cluster


def k8s_local_cluster(factory: Callable[..., Any], api: ReviewApi, tmp_path: Path,
                      master_args: tuple[str, ...] = ()) -> Any:
    """The k8s_cluster fixture's cluster, made by `factory` (make_cluster) but not started (`with cluster:`:
    it stops before the review API); `master_args` added to the master's; its workers' projected tokens in
    `.token_files` (node id -> file)."""
    emu, kubeconfig = api.emu, api.kubeconfig
    tokens = tmp_path / "tokens.json"
    entries = [{"name": "master", "token": MASTER, "role": "worker"}, {"name": "ops", "token": ADMIN, "role": "admin"}]
    tokens.write_text(json.dumps(entries))
    verifiers = tmp_path / "verifiers.json"
    verifiers.write_text(json.dumps([{"name": e["name"], "sha256": token_digest(e["token"]), "role": e["role"]}
                                     for e in entries]))
    token_files = {}
    for node in ("node-1", "node-2"):
        f = token_files[node] = tmp_path / f"{node}.token"
        tok = jwt(node)
        emu.table[tok] = (SA, node, ["l2fs"])
        f.write_text(tok)
    cluster = factory(2, started=False, token=ADMIN, heartbeat_timeout=3, heartbeat_interval=0.5,
                      master_args=["--tokens-file", str(tokens), "--token", MASTER, "--worker-identity", "k8s",
                                   "--worker-sa", "kvtier:l2fs-worker", "--worker-audience", "l2fs",
                                   "--kubeconfig", str(kubeconfig), *master_args],
                      each_worker_args=[["--tokens-file", str(verifiers), "--token-file", str(f)]
                                        for f in token_files.values()])
    cluster.token_files = token_files
    return cluster


def _ids(cluster: Any) -> dict[str, str]:
    with cluster.client() as c:
        return {w.node_id: w.worker_id for w in c.report().workers if w.alive}


def _attacks(cluster: Any, token: str, victim_node: str, victim_id: str) -> list[grpc.StatusCode]:
    m = pbg.MasterStub(grpc.insecure_channel(cluster.master))
    reg = pb.RegisterRequest(worker_id=victim_id, node_id=victim_node, address="127.0.0.1:1", capacity=1 << 30)
    reg_own_node = pb.RegisterRequest(worker_id=victim_id, node_id="node-1", address="127.0.0.1:1", capacity=1 << 30)
    return [_call(m.RegisterWorker, reg, token),
            _call(m.RegisterWorker, reg_own_node, token),
            _call(m.Heartbeat, pb.HeartbeatRequest(worker_id=victim_id), token),
            _call(m.RemoveBlocks, pb.BlocksRemoved(worker_id=victim_id), token)]


def test_node_token_registers_its_node_only(k8s_cluster: Any, api: ReviewApi) -> None:
    """Workers register with their projected tokens (no tokens file, no shared secret). node-1's token cannot
    register, heartbeat or report as node-2's worker, neither while node-2 is live nor right after a master
    restart (when no in-memory owner binding exists yet); node-2 keeps its address."""
    emu = api.emu
    ids = _ids(k8s_cluster)
    assert set(ids) == {"node-1", "node-2"}
    with k8s_cluster.client(token=ADMIN) as c:  # workers check the client's token against digests only
        assert c.put("/kv/x", b"k" * 70_000) is True and c.get("/kv/x") == b"k" * 70_000
    assert ids["node-1"].startswith("node-1") and ids["node-2"].startswith("node-2")
    node1 = k8s_cluster.token_files["node-1"].read_text()
    assert all(c == grpc.StatusCode.PERMISSION_DENIED for c in _attacks(k8s_cluster, node1, "node-2", ids["node-2"]))
    # the node-1 token does register node-1's own ids (the binding, not a blanket refusal)
    m = pbg.MasterStub(grpc.insecure_channel(k8s_cluster.master))
    assert _call(m.Heartbeat, pb.HeartbeatRequest(worker_id=ids["node-1"]), node1) == grpc.StatusCode.OK
    # node-2's worker is held stopped across the restart, so no binding of its id exists while node-1's token
    # tries it; node-1's worker re-registers meanwhile, from the same address, and may take the address's share
    # of fresh reviews: a call refused as not reviewed yet (UNAUTHENTICATED) is asked again, never answered OK
    w2_pid = [w for w in k8s_cluster.workers if w.node_id == "node-2"][0].proc.pid
    os.kill(w2_pid, signal.SIGSTOP)
    try:
        k8s_cluster.kill_master()
        k8s_cluster.start_master()
        deadline = time.monotonic() + 60
        while True:
            codes = _attacks(k8s_cluster, node1, "node-2", ids["node-2"])
            assert grpc.StatusCode.OK not in codes, codes
            # UNAVAILABLE: the restarted master not serving yet (a loaded box): asked again as well
            if not {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE} & set(codes) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert all(c == grpc.StatusCode.PERMISSION_DENIED for c in codes), codes
    finally:
        os.kill(w2_pid, signal.SIGCONT)
    k8s_cluster.wait_workers(2)
    with k8s_cluster.client() as c:
        w2 = [w for w in c.report().workers if w.worker_id == ids["node-2"]][0]
    assert w2.alive and w2.address != "127.0.0.1:1"
    assert node1 in emu.seen


def test_unknown_expired_or_foreign_tokens_are_refused(k8s_cluster: Any, api: ReviewApi) -> None:
    """A token the API server does not authenticate (unknown, expired), one of another ServiceAccount and one
    for another audience are UNAUTHENTICATED for worker calls; so is a static client token (admin) on them it
    is PERMISSION_DENIED (its role). When the API server cannot be reached, a new token is refused too."""
    emu, stop = api.emu, api.stop
    ids = _ids(k8s_cluster)
    other_sa = jwt("node-1")
    emu.table[other_sa] = ("system:serviceaccount:default:evil", "node-1", ["l2fs"])
    wrong_aud = jwt("node-1")
    emu.table[wrong_aud] = (SA, "node-1", ["https://kubernetes.default.svc"])
    no_node = jwt("node-1")
    emu.table[no_node] = (SA, "", ["l2fs"])
    m = pbg.MasterStub(grpc.insecure_channel(k8s_cluster.master))
    own = pb.RegisterRequest(worker_id="node-1-fresh", node_id="node-1", address="127.0.0.1:1", capacity=1 << 30)
    unauth = grpc.StatusCode.UNAUTHENTICATED
    for tok in ("not-a-jwt", jwt("node-1"), other_sa, wrong_aud, no_node):
        assert _call(m.RegisterWorker, own, tok) == unauth, tok
        assert _call(m.Heartbeat, pb.HeartbeatRequest(worker_id=ids["node-1"]), tok) == unauth, tok
    # a projected token is no client credential: non-worker methods do not even review it
    n = len(emu.seen)
    node1 = k8s_cluster.token_files["node-1"].read_text()
    assert _call(m.Report, pb.Empty(), node1) == unauth and _call(m.Report, pb.Empty(), jwt("x")) == unauth
    assert len(emu.seen) == n
    stop()  # API server gone: a token never reviewed before is refused, not waved through
    fresh = jwt("node-1")
    emu.table[fresh] = (SA, "node-1", ["l2fs"])
    assert _call(m.Heartbeat, pb.HeartbeatRequest(worker_id=ids["node-1"]), fresh) == unauth
    log = (k8s_cluster.base / "logs" / "master.log").read_text()
    assert "TokenReview failed" in log


def test_rotated_token_keeps_the_worker_registered(k8s_cluster: Any, api: ReviewApi) -> None:
    """The kubelet rewrites the projected token; the worker re-reads it per call, so the new token is what the
    master reviews and the worker stays alive past several heartbeat timeouts (the old one is no longer known
    to the API server)."""
    emu = api.emu
    ids = _ids(k8s_cluster)
    f = k8s_cluster.token_files["node-1"]
    old = f.read_text()
    new = jwt("node-1")
    emu.table[new] = (SA, "node-1", ["l2fs"])
    tmp = f.with_suffix(".new")
    tmp.write_text(new)
    tmp.replace(f)  # what the kubelet's atomic writer does
    del emu.table[old]
    wait_until(lambda: new in emu.seen, 10, 0.2, message="the rotated token was never presented")
    time.sleep(4)  # > the 3 s heartbeat timeout
    assert _ids(k8s_cluster).get("node-1") == ids["node-1"]
    # ~8 heartbeats at 0.5 s went by: a positive review is cached, not repeated per call
    assert emu.seen.count(new) <= 2, emu.seen.count(new)
