"""The FUSE mount's own credential (least privilege for mount pods): role `mount`, not admin.

Every mount pod holds the same token, and before this it was an admin token: a mount pod on any node could
overwrite, rename over or delete anything in the cache (an engine's chunks, another tenant's). A mount writes
new files under its prefixes (FUSE publishes them), re-publishes its own, and LMCache's fs:// connector renames
its own `<key>.tmp` onto the absent `<key>.data` (or unlinks it after a failed write); that is all the mount
role allows. Real master, workers and `l2fs mount` processes; stock LMCache's fs:// connector for mount mode.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from mount_helpers import Mount, assert_cannot_replace, start_mount
from test_mount_lmcache import _drive

from l2fs.testing.cluster import LocalCluster

MASTER = "master-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
MOUNT = "mount-token-0123456789abcdef"
ENGINE = "engine-token-0123456789abcdef"
KV = "/kvtier/kv"


@pytest.fixture(scope="module")
def scoped(tmp_path_factory: pytest.TempPathFactory,
           cluster_factory: Callable[..., LocalCluster]) -> Iterator[tuple[LocalCluster, Mount, Mount]]:
    base = tmp_path_factory.mktemp("scoped")
    c = cluster_factory(2, name="scoped-c", capacity="1G", token=ADMIN, tokens=[
        {"name": "master", "token": MASTER, "role": "worker"},
        {"name": "ops", "token": ADMIN, "role": "admin"},
        {"name": "mount", "token": MOUNT, "role": "mount", "prefixes": ["/kvtier"]},
        {"name": "engine-ep", "token": ENGINE, "role": "engine", "prefixes": [f"{KV}/ep"]}],
        master_args=["--token", MASTER], worker_args=["--token", MASTER])
    m1 = start_mount(base / "m1", c.master, "--node-id", "node-1", "--token", MOUNT)
    m2 = start_mount(base / "m2", c.master, "--node-id", "node-2", "--token", MOUNT)
    try:
        yield c, m1, m2
    finally:
        m1.stop()
        m2.stop()


def test_mount_mode_works_with_the_mount_role(scoped: tuple[LocalCluster, Mount, Mount]) -> None:
    """LMCache's fs:// connector (write key.tmp, os.replace onto key.data) through node 1's mount, read back
    byte-exact through node 2's; the mount's own files can be rewritten, renamed and removed."""
    c, m1, m2 = scoped
    pytest.importorskip("lmcache")
    rel = "kvtier/kv/lmc/tiny"
    stored = _drive("store", m1 / rel, 6)
    assert stored["stored"] == 6 and stored["tmp_left"] == 0, stored
    got = _drive("retrieve", m2 / rel, 6)
    assert got["exact"] == 6 and got["wrong"] == 0 and got["missing"] == 0, got
    own = m1 / "kvtier/kv/own"
    own.write_bytes(b"a" * 1000)
    own.write_bytes(b"b" * 2000)  # its own file: an overwrite
    os.rename(own, m1 / "kvtier/kv/own2")
    assert (m2 / "kvtier/kv/own2").read_bytes() == b"b" * 2000
    os.unlink(m1 / "kvtier/kv/own2")
    with c.client(token=ADMIN) as admin:
        assert admin.stat("/kvtier/kv/own2") is None


def test_mount_cannot_overwrite_rename_or_delete_others_files(scoped: tuple[LocalCluster, Mount, Mount]) -> None:
    """A file an engine wrote: through the mount, an overwrite, a truncate, a rename over it, a rename of it
    and an unlink all fail with EACCES and leave it as it was; writing outside the mount's prefixes fails."""
    c, m1, _ = scoped
    victim = f"{KV}/ep/chunk.data"
    data = os.urandom(100_000)
    with c.client(token=ENGINE) as engine:
        assert engine.put(victim, data) is True
    path = m1 / victim.lstrip("/")
    assert path.read_bytes() == data

    # the mount's own fresh file lives outside the engine's prefix (no mount creates under it: the engine
    # serves it, test_mount_endpoint_boundary.py)
    assert_cannot_replace(path, m1 / "kvtier/kv/mine.tmp", m1 / "kvtier/kv/ep/moved")
    with pytest.raises(OSError):
        (m1 / "elsewhere.bin").write_bytes(b"x")
    with c.client(token=ADMIN) as admin:
        assert admin.get(victim) == data
        assert admin.stat(f"{KV}/ep/moved") is None and admin.stat("/elsewhere.bin") is None
        assert admin.get(f"{KV}/mine.tmp") == b"poison" * 1000
    assert path.read_bytes() == data
    (m1 / "kvtier/kv/mine.tmp").unlink()
