"""What a node's FUSE mount may write: not another endpoint's KV (trust as deployed).

The mount credential's prefixes (`--mount-prefixes`, default the whole KV prefix) covered every endpoint's
directory, so a write through node 1's mount planted `/kvtier/kv/ep-b/<key>` (keys are deterministic and
listable): endpoint B's put then answered "exists" and B's engine loaded the planted bytes. Now a prefix that
an engine credential of the tokens file serves (a plugin-mode endpoint) is that endpoint's alone: no mount
creates, renames into or makes directories under it; mount-mode endpoints (no engine credential of their
own) are written through the mounts as before.

Real master, workers and a `l2fs mount` process with its own projected ServiceAccount token (master
`--mount-sa`, reviewed by kmock's TokenReview emulator, as deploy/base runs it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mount_helpers import Mount, start_mount

from l2fs.testing.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from operator_helpers import MOUNT_SA, jwt, review_api  # noqa: E402

pytestmark = pytest.mark.k8s

MASTER = "master-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
ENGINE_B = "engine-b-token-0123456789abcdef"
KV = "/kvtier/kv"


@contextlib.contextmanager
def _node_mount(base: Path, *master_args: str) -> Iterator[tuple[LocalCluster, Mount]]:
    """Master (--mount-sa, a tokens file in which endpoint B has an engine credential), a worker, and node 1's
    mount showing its own ServiceAccount token."""
    with review_api(base) as api:
        tokens = base / "tokens.json"
        tokens.write_text(json.dumps([
            {"name": "master", "token": MASTER, "role": "worker"},
            {"name": "ops", "token": ADMIN, "role": "admin"},
            {"name": "engine-ep-b", "token": ENGINE_B, "role": "engine", "prefixes": [f"{KV}/ep-b"]}]))
        sec = ["--tokens-file", str(tokens), "--token", MASTER]
        master = [*sec, "--mount-sa", "kvtier:l2fs-mount", "--worker-audience", "l2fs",
                  "--kubeconfig", str(api.kubeconfig), *master_args]
        with LocalCluster(base / "c", workers=1, capacity="512M", token=ADMIN, master_args=master,
                          worker_args=sec) as c:
            tok = jwt("node-1")
            api.emu.table[tok] = (MOUNT_SA, "node-1", ["l2fs"])
            token_file = base / "node-1.token"
            token_file.write_text(tok)
            m = start_mount(base / "m1", c.master, "--node-id", "node-1", "--token-file", str(token_file))
            try:
                yield c, m
            finally:
                m.stop()


@pytest.fixture(scope="module")
def node_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Mount]]:
    with _node_mount(tmp_path_factory.mktemp("epmount")) as got:  # --endpoint-writes plugin, the default
        yield got


def _errno(fn: Any) -> int | None:
    """The errno of the OSError `fn` raises; None when it went through."""
    try:
        fn()
    except OSError as e:
        return e.errno or -1
    return None


def test_mount_cannot_plant_another_endpoints_chunks(node_mount: tuple[LocalCluster, Mount]) -> None:
    """Through node 1's mount, a new file, a directory and a rename into B's (engine-served) prefix all fail;
    B's put of that key then publishes B's own bytes and B reads them back. A mount-mode endpoint's directory
    (no engine credential) is still written through the mount."""
    c, m = node_mount
    key = "chunk-0001.data"
    (m / "kvtier/kv/ep-b").mkdir(parents=True, exist_ok=True)  # the connector makes its own prefix dir

    def plant() -> None:
        with open(m / f"kvtier/kv/ep-b/{key}", "wb") as f:
            f.write(b"planted" * 1000)

    tried = {"create": _errno(plant), "mkdir": _errno(lambda: (m / "kvtier/kv/ep-b/sub").mkdir())}
    (m / "kvtier/kv/ep-m").mkdir(parents=True, exist_ok=True)
    own = m / "kvtier/kv/ep-m/mine.data"
    own.write_bytes(b"mount-mode endpoint" * 100)  # a mount-mode endpoint: written through the mount
    tried["rename"] = _errno(lambda: os.rename(own, m / "kvtier/kv/ep-b/renamed.data"))
    mine = os.urandom(50_000)
    with c.client(token=ENGINE_B) as b:
        assert b.put(f"{KV}/ep-b/{key}", mine) is True  # not "exists"
        assert b.get(f"{KV}/ep-b/{key}") == mine
        assert b.stat(f"{KV}/ep-b/renamed.data") is None and b.stat(f"{KV}/ep-b/sub") is None
    assert tried == {"create": errno.EACCES, "mkdir": errno.EACCES, "rename": errno.EACCES}, tried
    assert own.read_bytes() == b"mount-mode endpoint" * 100
    assert (m / f"kvtier/kv/ep-b/{key}").read_bytes() == mine  # the mount still reads B's chunks


def test_mount_mode_mounts_still_write_every_endpoint(tmp_path: Path) -> None:
    """With `--endpoint-writes mount` (deploy/ passes $(KVTIER_MODE): endpoints write through the node mounts,
    their engine credentials unused for KV) the mount writes under B's prefix as before, and an engine's put of
    that key then answers "exists"."""
    with _node_mount(tmp_path, "--endpoint-writes", "mount") as (c, m):
        (m / "kvtier/kv/ep-b").mkdir(parents=True, exist_ok=True)
        (m / "kvtier/kv/ep-b/chunk.data").write_bytes(b"through the mount" * 100)
        with c.client(token=ENGINE_B) as b:
            assert b.get(f"{KV}/ep-b/chunk.data") == b"through the mount" * 100
            assert b.put(f"{KV}/ep-b/chunk.data", b"other") is False
