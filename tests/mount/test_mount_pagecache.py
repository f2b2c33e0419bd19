"""`--page-cache` mode: read-only opens go through the kernel page cache, and an open of a file whose
published version (size, CRC32C from the master) is the one the kernel's pages hold keeps those pages
(FOPEN_KEEP_CACHE) instead of fetching the file again. Any other version drops them. Real mounts."""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from mount_helpers import Mount

from l2fs.testing.cluster import LocalCluster

MiB = 1 << 20


def read(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def test_kept_pages_serve_an_unchanged_file_without_its_worker(mount_factory: Callable[..., Mount],
                                                               make_cluster: Callable[..., LocalCluster]) -> None:
    """The second open fetches nothing: with the only worker killed (the master still knows the file), the
    page-cache mount still reads the right bytes, while a direct_io mount gets a miss (ENOENT)."""
    c = make_cluster(1)
    data = os.urandom(3 * MiB + 5)
    cl = c.client(node_id="node-1")
    cl.put("/k/a.data", data)
    cl.close()
    # node-2 has no worker: no short-circuit to the block file on disk, every fetch is remote
    cached = mount_factory(c.master, "--node-id", "node-2", "--page-cache")
    direct = mount_factory(c.master, "--node-id", "node-2")
    assert read(cached / "k" / "a.data") == data
    assert read(direct / "k" / "a.data") == data
    c.kill_worker(0, signal.SIGKILL)
    assert read(cached / "k" / "a.data") == data  # kept pages of the same version
    with pytest.raises(OSError) as e:
        read(direct / "k" / "a.data")
    assert e.value.errno == errno.ENOENT  # fault-as-miss where nothing is cached


def test_new_versions_drop_kept_pages(cluster: LocalCluster, mount_factory: Callable[..., Mount]) -> None:
    """A version published elsewhere is seen by the next open at once, whole (a longer file is not cut
    at the old size, same-size new bytes are not served from old pages), and a handle still open on the
    old version keeps reading that version."""
    writer = mount_factory(cluster.master, "--node-id", "node-1", "--page-cache")
    reader = mount_factory(cluster.master, "--node-id", "node-2", "--page-cache")
    (writer / "v").mkdir()
    versions = [os.urandom(MiB), os.urandom(2 * MiB + 7), os.urandom(2 * MiB + 7), os.urandom(2 * MiB + 7)]
    (writer / "v" / "f").write_bytes(versions[0])
    assert read(reader / "v" / "f") == versions[0]
    assert read(reader / "v" / "f") == versions[0]  # kept
    for v in versions[1:3]:
        (writer / "v" / "f").write_bytes(v)  # published on close
        assert read(reader / "v" / "f") == v
    with open(reader / "v" / "f", "rb", buffering=0) as old:
        assert old.read(MiB) == versions[2][:MiB]
        (writer / "v" / "f").write_bytes(versions[3])
        assert read(reader / "v" / "f") == versions[3]
        assert os.pread(old.fileno(), len(versions[2]), 0) == versions[2]  # its own version, whole
        assert read(reader / "v" / "f") == versions[3]
    assert read(reader / "v" / "f") == versions[3]
