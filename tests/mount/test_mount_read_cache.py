"""Read snapshots bounded (l2fs mount --read-cache): read-only handles that stay open no longer pin one
whole-file snapshot each. Before, read-only opens of 40 files of 8 MiB through an --allow-other mount, never
closed, took the mount daemon from 48 to 370 MiB (only write buffers were capped). A real mount, the
daemon's RSS measured around the attack (psutil)."""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil
from mount_helpers import Mount

from l2fs.testing.cluster import LocalCluster

MiB = 1 << 20
FILES, SIZE = 40, 8 * MiB


def rss_mib(m: Mount) -> float:
    return psutil.Process(m.proc.pid).memory_info().rss / MiB


def test_open_read_handles_do_not_pin_a_snapshot_each(cluster: LocalCluster,
                                                      mount_factory: Callable[..., Mount]) -> None:
    """40 files of 8 MiB opened read-only and held open (one read each) on a mount with --read-cache 64M:
    the daemon grows by far less than their 320 MiB, and every held handle still reads its whole file, byte
    for byte (an evicted snapshot is fetched again, the same version)."""
    c = cluster.client(node_id="node-1", timeout=30)  # seeding only: 320 MiB on a loaded 2-core box
    data = {i: os.urandom(SIZE) for i in range(FILES)}
    for i, d in data.items():
        assert c.put(f"/rc/f{i}", d, if_absent=False) is True
    m = mount_factory(cluster.master, "--node-id", "node-1", "--read-cache", "64M")
    assert len(os.listdir(m / "rc")) == FILES
    before = rss_mib(m)
    fds = [os.open(m / "rc" / f"f{i}", os.O_RDONLY) for i in range(FILES)]
    try:
        for fd in fds:
            assert len(os.pread(fd, 4096, 0)) == 4096
        grew = rss_mib(m) - before
        assert grew < 200, f"the mount grew by {grew:.0f} MiB holding {FILES} open files of {SIZE // MiB} MiB"
        for i in range(0, FILES, 4):  # handles whose snapshots were evicted read the whole version again
            got = bytearray()
            while len(got) < SIZE:
                chunk = os.pread(fds[i], 1 << 20, len(got))
                assert chunk, f"f{i}: short read at {len(got)}"
                got += chunk
            assert bytes(got) == data[i], f"f{i}: wrong bytes"
        assert rss_mib(m) - before < 200
    finally:
        for fd in fds:
            os.close(fd)
