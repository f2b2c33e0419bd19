"""A per-endpoint mount credential (`mount-<endpoint>`, what deploy/'s mount DaemonSet holds per endpoint) reads
only its endpoint's prefix, through FUSE as through the client.

deploy/ mounts each endpoint at its own prefix (`--root`), but the credential itself read every endpoint: a
mount of it over the whole tree (a misconfigured --root, or the token taken out of the DaemonSet's Secret)
listed /kvtier/kv with every endpoint's directory and read B's chunks. Now such a mount shows /kvtier/kv with
A's directory only, B's paths are ENOENT, and A's own files still write and read, also across nodes. Real
master, workers and `l2fs mount` processes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator

import pytest
from mount_helpers import Mount, start_mount

from l2fs.testing.cluster import LocalCluster

MASTER = "master-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
ENGINE_A = "engine-a-token-0123456789abcdef"
ENGINE_B = "engine-b-token-0123456789abcdef"
MOUNT_A = "mount-a-token-0123456789abcdef"
KV = "/kvtier/kv"
A, B = f"{KV}/ep-a", f"{KV}/ep-b"
B_KEY = f"{B}/rev1/vllm@%2Fopt%2Fml%2Fmodel@1@0@00c0ffee00c0ffee@bfloat16.data"
A_KEY = f"{A}/rev1/vllm@%2Fopt%2Fml%2Fmodel@1@0@0a0a0a0a0a0a0a0a@bfloat16.data"


@pytest.fixture(scope="module")
def mounts(tmp_path_factory: pytest.TempPathFactory,
           cluster_factory: Callable[..., LocalCluster]) -> Iterator[tuple[LocalCluster, Mount, Mount, Mount]]:
    """Two workers; A's endpoint mount (root A) on node-1 and node-2, as deployed, and one more mount of
    mount-ep-a's credential on node-1 over the whole tree (root /)."""
    import json

    base = tmp_path_factory.mktemp("readscope-mount")
    tokens = base / "tokens.json"
    tokens.write_text(json.dumps([
        {"name": "master", "token": MASTER, "role": "worker"},
        {"name": "ops", "token": ADMIN, "role": "admin"},
        {"name": "engine-ep-a", "token": ENGINE_A, "role": "engine", "prefixes": [A]},
        {"name": "engine-ep-b", "token": ENGINE_B, "role": "engine", "prefixes": [B]},
        {"name": "mount-ep-a", "token": MOUNT_A, "role": "mount", "prefixes": [A]}]))
    sec = ["--tokens-file", str(tokens), "--token", MASTER]
    c = cluster_factory(2, name="readscope-mount-c", capacity="512M", token=ADMIN, master_args=sec, worker_args=sec)
    with c.client(token=ENGINE_B) as b, c.client(token=ENGINE_A) as a:
        assert b.put(B_KEY, b"B's KV" * 1000) is True
        assert a.put(A_KEY, b"A's KV" * 1000) is True
    started: list[Mount] = []
    try:
        for name, node, root in (("a1", "node-1", A), ("a2", "node-2", A), ("wide", "node-1", "/")):
            started.append(start_mount(base / name, c.master, "--node-id", node, "--token", MOUNT_A, "--root", root))
        yield c, started[0], started[1], started[2]
    finally:
        for m in started:
            m.stop()


def test_endpoint_mount_credential_sees_only_its_endpoint(mounts: tuple[LocalCluster, Mount, Mount, Mount]) -> None:
    """Through mount-ep-a's credential mounted over /: /kvtier/kv lists ep-a only, B's directory and chunk are
    ENOENT (stat, open, listdir); A's chunk reads. A's endpoint mounts (as deployed) still work: a file
    written through node-1's reads back through node-2's and lands under A's prefix, the engine's chunk reads
    through both."""
    c, a1, a2, wide = mounts
    assert sorted(os.listdir(wide / "kvtier/kv")) == ["ep-a"]
    assert sorted(os.listdir(wide / "kvtier")) == ["kv"]
    rel_b, rel_a = B_KEY.lstrip("/"), A_KEY.lstrip("/")
    for attempt in (lambda: os.stat(wide / "kvtier/kv/ep-b"), lambda: os.listdir(wide / "kvtier/kv/ep-b"),
                    lambda: os.stat(wide / rel_b), lambda: (wide / rel_b).read_bytes()):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.ENOENT
    assert (wide / rel_a).read_bytes() == b"A's KV" * 1000
    with c.client(token=MOUNT_A) as mnt:
        assert mnt.stat(B_KEY) is None and mnt.get(B_KEY) is None and mnt.prefix_lookup([B_KEY]) == 0
    # as deployed: A's endpoint mounts, root A
    rel = A_KEY.removeprefix(A + "/")
    assert (a1 / rel).read_bytes() == b"A's KV" * 1000 and (a2 / rel).read_bytes() == b"A's KV" * 1000
    (a1 / "rev1" / "through-mount.data").write_bytes(b"written on node-1" * 100)
    assert (a2 / "rev1" / "through-mount.data").read_bytes() == b"written on node-1" * 100
    assert sorted(os.listdir(a2 / "rev1")) == sorted([rel.split("/", 1)[1], "through-mount.data"])
    with c.client(token=ADMIN) as admin:
        assert admin.get(f"{A}/rev1/through-mount.data") == b"written on node-1" * 100
        assert admin.get(B_KEY) == b"B's KV" * 1000
