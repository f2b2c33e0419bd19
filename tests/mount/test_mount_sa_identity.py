"""One mount identity per node (least privilege for mount pods): each FUSE mount pod presents its own
projected ServiceAccount token (`l2fs mount --token-file`, re-read per call); the master (`--mount-sa`) reviews
it with a TokenReview and names the caller `mount@<node>` from the node the review names. The mount role may
replace, rename or delete only files its own credential wrote (Credential.may_replace), so with per-node names
node 2's mount can no longer touch what node 1's mount wrote. With the one mount token every mount pod shared
before (Secret l2fs-mount-token), it could: shown below with that token.

Real master, workers and two `l2fs mount` processes; the API server is kmock's emulator answering TokenReviews
from a table (tests/operator/operator_helpers.py). The workers know only the master's and the admin's tokens:
the mounts move bytes with the master's per-block capabilities, not with their token.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from mount_helpers import Mount, assert_cannot_replace, metric, start_mount

from l2fs.client import PermissionDenied
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.testing.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from operator_helpers import MOUNT_SA, SA, jwt, review_api  # noqa: E402

pytestmark = pytest.mark.k8s

MASTER = "master-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
SHARED = "shared-mount-token-0123456789abcdef"  # the one mount token of before
KV = "/kvtier/kv"


@pytest.fixture(scope="module")
def sa_mounts(tmp_path_factory: pytest.TempPathFactory,
              cluster_factory: Callable[..., LocalCluster]) -> Iterator[tuple[LocalCluster, Mount, Mount, Any]]:
    """Master (--mount-sa) and two workers, and the mounts of node-1 and node-2 with their own ServiceAccount
    tokens (`.token_files`); the cluster stops before the TokenReview API it uses."""
    base = tmp_path_factory.mktemp("samount")
    with review_api(base) as api:
        c = cluster_factory(2, name="samount", started=False, capacity="1G", token=ADMIN, tokens=[
            {"name": "master", "token": MASTER, "role": "worker"},
            {"name": "ops", "token": ADMIN, "role": "admin"},
            {"name": "mount", "token": SHARED, "role": "mount", "prefixes": ["/kvtier"]}],
            master_args=["--token", MASTER, "--mount-sa", "kvtier:l2fs-mount", "--worker-audience", "l2fs",
                         "--kubeconfig", str(api.kubeconfig)],
            worker_args=["--token", MASTER])
        with c:
            files = {}
            for node in ("node-1", "node-2"):
                tok = jwt(node)
                api.emu.table[tok] = (MOUNT_SA, node, ["l2fs"])
                files[node] = base / f"{node}.token"
                files[node].write_text(tok)
            m1 = start_mount(base / "m1", c.master, "--node-id", "node-1", "--token-file", str(files["node-1"]))
            m2 = start_mount(base / "m2", c.master, "--node-id", "node-2", "--token-file", str(files["node-2"]))
            c.token_files = files
            try:
                yield c, m1, m2, api
            finally:
                m1.stop()
                m2.stop()


def test_each_node_mount_replaces_only_its_own_files(sa_mounts: tuple[LocalCluster, Mount, Mount, Any]) -> None:
    """Written through node 1's mount, read byte-exact through node 2's; through node 2's mount a truncate, an
    overwrite, a rename over it, a rename of it and an unlink of node 1's file all fail with EACCES and leave it
    as it was; node 1's mount still rewrites, renames and removes its own file."""
    c, m1, m2, api = sa_mounts
    victim = f"{KV}/ep/chunk.data"
    data = os.urandom(200_000)
    (m1 / "kvtier/kv/ep").mkdir(parents=True, exist_ok=True)
    (m1 / victim.lstrip("/")).write_bytes(data)
    path = m2 / victim.lstrip("/")
    assert path.read_bytes() == data
    mine = m2 / "kvtier/kv/ep/mine.tmp"  # a fresh file of node 2's own: allowed
    assert_cannot_replace(path, mine, m2 / "kvtier/kv/ep/moved")
    with c.client(token=ADMIN) as admin:
        assert admin.get(victim) == data
        assert admin.stat(f"{KV}/ep/moved") is None
        assert admin.get(f"{KV}/ep/mine.tmp") == b"poison" * 1000
    os.unlink(mine)  # its own
    # node 1's mount: its own file it may overwrite, rename and delete
    own = m1 / victim.lstrip("/")
    own.write_bytes(b"b" * 3000)
    os.rename(own, m1 / "kvtier/kv/ep/own2")
    assert (m2 / "kvtier/kv/ep/own2").read_bytes() == b"b" * 3000
    os.unlink(m1 / "kvtier/kv/ep/own2")
    with c.client(token=ADMIN) as admin:
        assert admin.stat(f"{KV}/ep/own2") is None and admin.stat(victim) is None
    assert all(c.token_files[n].read_text() in api.emu.seen for n in ("node-1", "node-2"))


def test_shared_mount_token_could_and_foreign_tokens_cannot(
        sa_mounts: tuple[LocalCluster, Mount, Mount, Any]) -> None:
    """The contrast: with the one shared mount token (what every mount pod held before), node 2 deletes and
    overwrites what node 1 wrote. A token of another ServiceAccount, one naming no node and one for another
    audience are refused on the client methods (writes and reads); a mount pod's token cannot act as a
    worker, a worker pod's is no client credential."""
    c, *_, api = sa_mounts
    with c.client(token=SHARED, node_id="node-1") as n1, c.client(token=SHARED, node_id="node-2") as n2:
        assert n1.put(f"{KV}/shared/a", b"1" * 1000) is True
        assert n2.put(f"{KV}/shared/a", b"2" * 1000, if_absent=False) is True  # replaced node 1's file
        assert n2.rm(f"{KV}/shared/a") is True
        assert n1.stat(f"{KV}/shared/a") is None
    other_sa, no_node, wrong_aud = jwt("node-1"), jwt("node-1"), jwt("node-1")
    api.emu.table[other_sa] = ("system:serviceaccount:kvtier:default", "node-1", ["l2fs"])
    api.emu.table[no_node] = (MOUNT_SA, "", ["l2fs"])
    api.emu.table[wrong_aud] = (MOUNT_SA, "node-1", ["https://kubernetes.default.svc"])
    for tok in (other_sa, no_node, wrong_aud, jwt("forged")):
        with c.client(token=tok, node_id="node-1") as cl:
            with pytest.raises(PermissionDenied):
                cl.put(f"{KV}/foreign", b"x" * 1000)
            with pytest.raises(PermissionDenied):
                cl.stat(f"{KV}/ep")
    with c.client(token=ADMIN) as admin:
        assert admin.stat(f"{KV}/foreign") is None
    # roles do not cross: a mount pod's token cannot register a worker of its node, a worker pod's token is no
    # client credential (only --mount-sa is configured here: no review on worker methods)
    m = pbg.MasterStub(grpc.insecure_channel(c.master))
    reg = pb.RegisterRequest(worker_id="node-1@evil", node_id="node-1", address="127.0.0.1:1", capacity=1 << 30)
    node1 = c.token_files["node-1"].read_text()
    worker_tok = jwt("node-1")
    api.emu.table[worker_tok] = (SA, "node-1", ["l2fs"])
    for tok, method, req in ((node1, m.RegisterWorker, reg), (worker_tok, m.Report, pb.Empty())):
        with pytest.raises(grpc.RpcError) as err:
            method(req, timeout=10, metadata=(("authorization", f"Bearer {tok}"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, tok
    assert worker_tok in api.emu.seen  # Report is a client method: reviewed, and not the mounts' ServiceAccount


def test_mount_rereads_its_token_file(sa_mounts: tuple[LocalCluster, Mount, Mount, Any]) -> None:
    """`--token-file` is read per call (the kubelet rotates the projected token): a rotated token the API
    server knows keeps the mount working after the old one is forgotten; an unknown token in the file makes
    the next write fail."""
    c, m1, _, api = sa_mounts
    f = c.token_files["node-1"]
    bad = f.with_suffix(".new")
    bad.write_text(jwt("nobody"))
    bad.replace(f)
    with pytest.raises(OSError):
        (m1 / "kvtier/kv/rot-bad").write_bytes(b"x" * 100)
    new = jwt("node-1")
    api.emu.table[new] = (MOUNT_SA, "node-1", ["l2fs"])
    bad.write_text(new)
    bad.replace(f)
    (m1 / "kvtier/kv/rot-ok").write_bytes(b"y" * 100)
    assert new in api.emu.seen
    with c.client(token=ADMIN) as admin:
        assert admin.get(f"{KV}/rot-ok") == b"y" * 100 and admin.stat(f"{KV}/rot-bad") is None


def _bytes_served(c: LocalCluster, i: int) -> float:
    return metric(c.workers[i].metrics_port, "l2fs_worker_bytes_read_total")


def test_pod_token_mount_still_reads_same_node_blocks_locally(
        sa_mounts: tuple[LocalCluster, Mount, Mount, Any]) -> None:
    """A mount with a pod token writes over the data plane (the workers do not know its token), but reads a
    same-node block without asking the worker to serve it (short-circuit), and a remote one over the network."""
    c, m1, m2, _ = sa_mounts
    assert c.workers[0].node_id == "node-1"
    data = os.urandom(300_000)
    with c.client(token=ADMIN, node_id="node-1") as admin:
        assert admin.put(f"{KV}/local/blk.data", data) is True
        assert admin.stat(f"{KV}/local/blk.data").nodes == ["node-1"]  # type: ignore[union-attr]
    before = _bytes_served(c, 0)
    assert (m1 / "kvtier/kv/local/blk.data").read_bytes() == data  # node 1's mount: same node
    assert _bytes_served(c, 0) == before
    assert (m2 / "kvtier/kv/local/blk.data").read_bytes() == data  # node 2's mount: served by the worker
    assert _bytes_served(c, 0) >= before + len(data)
