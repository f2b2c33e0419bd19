"""Bounded memory of the mount process: the attacks of the audit, replayed against a real
`l2fs mount`, with the mount's RSS measured around each one (psutil)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable

import psutil
import pytest
from mount_helpers import Mount

from l2fs.testing.cluster import LocalCluster

MiB = 1 << 20


def rss_mib(m: Mount) -> float:
    return psutil.Process(m.proc.pid).memory_info().rss / MiB


def test_truncate_and_write_past_max_file_size_are_efbig(cluster: LocalCluster,
                                                         mount_factory: Callable[..., Mount]) -> None:
    """`truncate -s 2G` once took the mount from 51 to 2,099 MiB: now EFBIG before anything is allocated."""
    m = mount_factory(cluster.master, "--node-id", "node-1")  # default --max-file-size 1G, as the master
    (m / "big").mkdir()
    before = rss_mib(m)
    r = subprocess.run(["truncate", "-s", "2G", str(m / "big" / "a")], capture_output=True, text=True)
    assert r.returncode != 0 and "too large" in r.stderr.lower(), r.stderr
    fd = os.open(m / "big" / "b", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"x", 2 << 30)  # a write far past the end would have zero-filled 2 GiB
        assert e.value.errno == errno.EFBIG
        with pytest.raises(OSError) as e:
            os.ftruncate(fd, (1 << 30) + 1)
        assert e.value.errno == errno.EFBIG
        os.write(fd, b"still usable")
    finally:
        os.close(fd)
    # truncate(path) of a published file (read-modify-publish) is bounded the same way
    with pytest.raises(OSError) as e:
        os.truncate(m / "big" / "b", 3 << 30)
    assert e.value.errno == errno.EFBIG
    assert (m / "big" / "b").read_bytes() == b"still usable"
    assert rss_mib(m) - before < 64, f"mount RSS grew from {before:.0f} to {rss_mib(m):.0f} MiB"


def test_read_opens_share_one_snapshot(cluster: LocalCluster, mount_factory: Callable[..., Mount]) -> None:
    """8 opens of a 96 MiB file cost one snapshot, not 8 private copies (once +674 MiB); a new version
    published meanwhile is fetched for new opens while open handles keep theirs."""
    c = cluster.client(node_id="node-1")
    old, new = os.urandom(96 * MiB), os.urandom(96 * MiB)
    c.put("/snap/f.bin", old, if_absent=False)
    m = mount_factory(cluster.master, "--node-id", "node-1")
    path = m / "snap" / "f.bin"
    assert os.stat(path).st_size == len(old)
    before = rss_mib(m)
    fds = [os.open(path, os.O_RDONLY) for _ in range(8)]
    try:
        grown = rss_mib(m) - before
        assert grown < 2 * 96, f"8 opens of a 96 MiB file grew the mount by {grown:.0f} MiB"
        assert os.pread(fds[0], len(old), 0) == old and os.pread(fds[7], MiB, 5 * MiB) == old[5 * MiB:6 * MiB]
        c.put("/snap/f.bin", new, if_absent=False)
        fd = os.open(path, os.O_RDONLY)  # sees the new version although the old snapshot is still shared
        fds.append(fd)
        assert os.pread(fd, len(new), 0) == new
        assert os.pread(fds[3], len(old), 0) == old  # an open handle keeps the version it opened
    finally:
        for fd in fds:
            os.close(fd)
    c.close()


def test_write_buffers_are_capped(cluster: LocalCluster, mount_factory: Callable[..., Mount]) -> None:
    """Unfinished writes across the mount are capped by --write-buffer: beyond it ENOSPC, never unbounded
    growth; closing (publishing) other files frees room and the file can be finished."""
    m = mount_factory(cluster.master, "--node-id", "node-1", "--write-buffer", "64M")
    (m / "wb").mkdir()
    piece = os.urandom(MiB)
    before = rss_mib(m)
    fds = [os.open(m / "wb" / f"f{i}", os.O_WRONLY | os.O_CREAT) for i in range(3)]
    written = [0, 0, 0]
    try:
        for i in range(2):
            for _ in range(30):
                written[i] += os.write(fds[i], piece)
        with pytest.raises(OSError) as e:
            for _ in range(30):
                written[2] += os.write(fds[2], piece)
        assert e.value.errno == errno.ENOSPC
        assert written[2] < 5 * MiB
        # a sparse write far ahead is charged too (it zero-fills the buffer)
        with pytest.raises(OSError) as e:
            os.pwrite(fds[2], b"x", 100 * MiB)
        assert e.value.errno == errno.ENOSPC
        assert rss_mib(m) - before < 64 + 48, f"mount RSS grew by {rss_mib(m) - before:.0f} MiB"
        for i in range(2):
            os.close(fds[i])
            fds[i] = -1
        while written[2] < 30 * MiB:  # room again once the others are published
            written[2] += os.write(fds[2], piece)
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    assert [os.stat(m / "wb" / f"f{i}").st_size for i in range(3)] == [30 * MiB] * 3
    assert (m / "wb" / "f2").read_bytes() == piece * 30


def test_pooled_snapshot_buffers_never_mix_files(cluster: LocalCluster,
                                                 mount_factory: Callable[..., Mount]) -> None:
    """Freed snapshots are reused for later opens: concurrent readers of files of close sizes (one buffer
    may serve several of them in turn) always get each file's own bytes and length, and the daemon lives
    (a release racing an open that was still checksumming the shared snapshot once freed it under it)."""
    import random
    import threading

    c = cluster.client(node_id="node-1")
    sizes = [MiB, MiB + 3, MiB - 4096, 2 * MiB, 7, 0]
    files = {f"/pool/f{i}": os.urandom(n) for i, n in enumerate(sizes)}
    for p, d in files.items():
        c.put(p, d, if_absent=False)
    c.close()
    m = mount_factory(cluster.master, "--node-id", "node-1")
    errors: list[str] = []

    def reader(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(40):
            p = rnd.choice(list(files))
            try:
                with open(m.path / p[1:], "rb", buffering=0) as f:
                    got = f.read()
            except OSError as e:  # e.g. ENOTCONN: the daemon died (a snapshot freed under an open once did)
                errors.append(f"{p}: {e!r}")
                return
            if got != files[p]:
                errors.append(f"{p}: {len(got)} bytes, expected {len(files[p])}")

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
