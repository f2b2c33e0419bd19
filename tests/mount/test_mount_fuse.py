"""`l2fs mount` through real FUSE: two mounts of one LocalCluster acting as node-1 and node-2."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mount_helpers import Mount, metric, start_mount
from polling import wait_until

from l2fs.fuse import is_mounted, mount_type
from l2fs.testing.cluster import LocalCluster


def _d(m: Mount, tmp_path: Path) -> Path:
    """A directory unique to this test on mount m (the cluster is shared by the module)."""
    d = m / tmp_path.name
    d.mkdir(exist_ok=True)
    return d


def test_write_on_node1_read_on_node2(cluster: LocalCluster, two_mounts: tuple[Mount, Mount],
                                      tmp_path: Path) -> None:
    m1, m2 = two_mounts
    d1, d2 = _d(m1, tmp_path), m2 / tmp_path.name
    data = os.urandom(3 << 20) + b"tail"
    (d1 / "a.bin").write_bytes(data)
    # visible through node 2 at once, byte-exact, and through the native client
    assert (d2 / "a.bin").read_bytes() == data
    assert os.stat(d2 / "a.bin").st_size == len(data)
    c = cluster.client()
    info = c.stat(f"/{tmp_path.name}/a.bin")
    assert info is not None and info.size == len(data)
    assert info.nodes == ["node-1"], "a mount with --node-id node-1 must place its writes on node-1"
    assert c.get(f"/{tmp_path.name}/a.bin") == data
    # and the other way round
    (d2 / "b.bin").write_bytes(b"from node 2")
    assert (d1 / "b.bin").read_bytes() == b"from node 2"
    assert sorted(os.listdir(d1)) == ["a.bin", "b.bin"]
    # an empty file is a file too
    (d1 / "empty").write_bytes(b"")
    assert (d2 / "empty").read_bytes() == b"" and (d2 / "empty").is_file()


def test_no_negative_caching_and_unlink_visibility(two_mounts: tuple[Mount, Mount], tmp_path: Path) -> None:
    m1, m2 = two_mounts
    d1, d2 = _d(m1, tmp_path), m2 / tmp_path.name
    for i in range(3):
        p2 = d2 / f"late{i}.data"
        assert not p2.exists()  # a miss on node 2 ...
        (d1 / f"late{i}.data").write_bytes(b"x" * (i + 1))
        assert p2.read_bytes() == b"x" * (i + 1)  # ... is not remembered: the file is seen immediately
    os.unlink(d1 / "late0.data")
    with pytest.raises(FileNotFoundError):
        (d1 / "late0.data").read_bytes()
    # node 2 may keep its positive dentry for <= 1 s, but an open must not return the removed data
    with pytest.raises(FileNotFoundError):
        (d2 / "late0.data").read_bytes()
    t0 = time.monotonic()
    while (d2 / "late0.data").exists():
        assert time.monotonic() - t0 < 1.5, "unlink on node 1 not visible on node 2 after the 1 s attr timeout"
        time.sleep(0.05)


def test_atomic_rename_over_existing_file(two_mounts: tuple[Mount, Mount], tmp_path: Path) -> None:
    """LMCache's FSConnector pattern: write key.tmp, os.replace(key.tmp, key.data)."""
    m1, m2 = two_mounts
    d1, d2 = _d(m1, tmp_path), m2 / tmp_path.name
    (d1 / "k.data").write_bytes(b"old" * 1000)
    assert (d2 / "k.data").read_bytes() == b"old" * 1000
    new = os.urandom(1 << 20)
    with open(d1 / "k.tmp", "wb") as f:
        f.write(new)
    os.replace(d1 / "k.tmp", d1 / "k.data")
    assert not (d1 / "k.tmp").exists()
    assert (d1 / "k.data").read_bytes() == new
    assert (d2 / "k.data").read_bytes() == new  # node 2 had the old one open-able a moment ago
    assert not (d2 / "k.tmp").exists()
    # renameat2(RENAME_NOREPLACE) must not replace
    (d1 / "other").write_bytes(b"other")
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.renameat2(-100, bytes(d1 / "other"), -100, bytes(d1 / "k.data"), 1)  # AT_FDCWD, NOREPLACE
    assert rc == -1 and ctypes.get_errno() == errno.EEXIST
    assert (d2 / "k.data").read_bytes() == new
    # rename of a file onto a directory is refused
    os.mkdir(d1 / "sub")
    with pytest.raises(OSError) as ei:
        os.rename(d1 / "k.data", d1 / "sub")
    assert ei.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)


def test_rename_across_directories_is_supported(two_mounts: tuple[Mount, Mount], tmp_path: Path) -> None:
    m1, m2 = two_mounts
    d1 = _d(m1, tmp_path)
    (d1 / "src").mkdir()
    (d1 / "dst").mkdir()
    (d1 / "src" / "f").write_bytes(b"moved")
    os.rename(d1 / "src" / "f", d1 / "dst" / "f")
    assert os.listdir(d1 / "src") == []
    assert (m2 / tmp_path.name / "dst" / "f").read_bytes() == b"moved"
    # a whole directory moves too
    (d1 / "dst" / "g").write_bytes(b"g")
    os.rename(d1 / "dst", d1 / "moved")
    assert sorted(os.listdir(m2 / tmp_path.name / "moved")) == ["f", "g"]
    assert (d1 / "moved" / "g").read_bytes() == b"g"


def test_mkdir_rmdir_stat_errors(two_mounts: tuple[Mount, Mount], tmp_path: Path) -> None:
    m1, _ = two_mounts
    d1 = _d(m1, tmp_path)
    os.mkdir(d1 / "x")
    with pytest.raises(FileExistsError):
        os.mkdir(d1 / "x")
    (d1 / "x" / "f").write_bytes(b"1")
    with pytest.raises(OSError) as ei:
        os.rmdir(d1 / "x")
    assert ei.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        os.listdir(d1 / "x" / "f")
    os.unlink(d1 / "x" / "f")
    os.rmdir(d1 / "x")
    assert not (d1 / "x").exists()
    with pytest.raises(FileNotFoundError):
        os.unlink(d1 / "nope")
    with pytest.raises(FileNotFoundError):
        os.stat(d1 / "nope")
    st = os.statvfs(d1)
    assert st.f_namemax == 255 and st.f_blocks > 0


def test_name_too_long(two_mounts: tuple[Mount, Mount], tmp_path: Path) -> None:
    d1 = _d(two_mounts[0], tmp_path)
    long = "n" * 256
    for op in (lambda: open(d1 / long, "wb"), lambda: os.mkdir(d1 / long), lambda: os.stat(d1 / long)):
        with pytest.raises(OSError) as ei:
            op()
        assert ei.value.errno == errno.ENAMETOOLONG
    (d1 / "ok").write_bytes(b"1")
    with pytest.raises(OSError) as ei:
        os.rename(d1 / "ok", d1 / long)
    assert ei.value.errno == errno.ENAMETOOLONG
    (d1 / ("m" * 255)).write_bytes(b"255 is fine")
    assert (d1 / ("m" * 255)).read_bytes() == b"255 is fine"


def test_read_only_mount(cluster: LocalCluster, mount_factory: Callable[..., Mount], tmp_path: Path) -> None:
    rw = mount_factory(cluster.master, "--node-id", "node-1")
    d = _d(rw, tmp_path)
    (d / "f").write_bytes(b"data")
    ro = mount_factory(cluster.master, "--node-id", "node-2", "--read-only")
    dro = ro / tmp_path.name
    assert (dro / "f").read_bytes() == b"data"
    ops = [lambda: open(dro / "g", "wb"), lambda: open(dro / "f", "r+b"), lambda: os.mkdir(dro / "d"),
           lambda: os.unlink(dro / "f"), lambda: os.rename(dro / "f", dro / "h"),
           lambda: os.truncate(dro / "f", 0)]
    for op in ops:
        with pytest.raises(OSError) as ei:
            op()
        assert ei.value.errno == errno.EROFS
    assert (d / "f").read_bytes() == b"data"


def test_concurrent_writers_one_name(two_mounts: tuple[Mount, Mount], tmp_path: Path) -> None:
    """Writers on both nodes replace one name over and over; every read sees one whole payload."""
    m1, m2 = two_mounts
    d1, d2 = _d(m1, tmp_path), m2 / tmp_path.name
    payloads = [bytes([i]) * (200_000 + 7919 * i) for i in range(6)]
    (d1 / "hot").write_bytes(payloads[0])
    stop = time.monotonic() + 4.0
    errors: list[str] = []
    reads = [0]

    def writer(d: Path, i: int) -> None:
        while time.monotonic() < stop:
            try:
                (d / "hot").write_bytes(payloads[i])
            except OSError as e:
                errors.append(f"writer {i}: {e!r}")

    def reader(d: Path) -> None:
        while time.monotonic() < stop:
            try:
                got = (d / "hot").read_bytes()
            except FileNotFoundError:
                continue  # an overwrite in flight on another node may look like a miss, never torn data
            reads[0] += 1
            if got not in payloads:
                errors.append(f"torn read of {len(got)} bytes")

    ts = [threading.Thread(target=writer, args=(d, i)) for i, d in ((1, d1), (2, d2), (3, d1), (4, d2))]
    ts += [threading.Thread(target=reader, args=(d,)) for d in (d1, d2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:5]
    assert reads[0] > 10
    final = (d2 / "hot").read_bytes()
    assert final in payloads[1:5]
    assert (d1 / "hot").read_bytes() == final


def test_large_flat_directory(cluster: LocalCluster, two_mounts: tuple[Mount, Mount], tmp_path: Path) -> None:
    m1, m2 = two_mounts
    _d(m1, tmp_path)
    names = [f"{i:06d}.data" for i in range(2000)]
    c = cluster.client(node_id="node-1")
    c.put_many([(f"/{tmp_path.name}/{n}", b"%d" % i) for i, n in enumerate(names)])
    listed = os.listdir(m2 / tmp_path.name)
    assert sorted(listed) == names
    with os.scandir(m1 / tmp_path.name) as it:
        sizes = {e.name: e.stat().st_size for e in it}
    assert len(sizes) == 2000 and sizes["001999.data"] == 4
    assert sorted(p.stem for p in (m1 / tmp_path.name).glob("*.data")) == [n[:-5] for n in names]


def test_partial_reads_seek_truncate_append(two_mounts: tuple[Mount, Mount], tmp_path: Path) -> None:
    m1, m2 = two_mounts
    d1, d2 = _d(m1, tmp_path), m2 / tmp_path.name
    data = os.urandom(5 << 20)
    (d1 / "f").write_bytes(data)
    with open(d2 / "f", "rb") as f:
        f.seek(1_234_567)
        assert f.read(1000) == data[1_234_567:1_235_567]
        buf = bytearray(len(data))
        f.seek(0)
        assert f.readinto(buf) == len(data) and buf == data
    with open(d1 / "f", "r+b") as f:  # in-place edit publishes the whole new content on close
        f.seek(10)
        f.write(b"EDIT")
    assert (d2 / "f").read_bytes() == data[:10] + b"EDIT" + data[14:]
    os.truncate(d1 / "f", 100)
    assert (d2 / "f").read_bytes() == data[:10] + b"EDIT" + data[14:100]
    with open(d2 / "f", "ab") as f:
        f.write(b"++")
    assert (d1 / "f").read_bytes()[-2:] == b"++" and os.path.getsize(d1 / "f") == 102


def test_dead_master_fails_fast_and_recovers(mount_factory: Callable[..., Mount],
                                             make_cluster: Callable[..., LocalCluster]) -> None:
    c = make_cluster(1, capacity="1G", master_args=["--max-file-size", "1M"])
    m = mount_factory(c.master, "--node-id", "node-1", "--timeout", "1")
    (m / "f").write_bytes(b"before")
    with pytest.raises(OSError) as ei:  # over the cluster's max file size: refused at close
        (m / "big").write_bytes(b"x" * (2 << 20))
    assert ei.value.errno == errno.EFBIG
    # the refused new file is dropped; the kernel forgets its dentry through an asynchronous
    # invalidation, so allow the attribute-cache bound (1 s) for the name to vanish
    wait_until(lambda: not (m / "big").exists(), 2.0)
    c.kill_master(signal.SIGKILL)
    for op in (lambda: os.stat(m / "new-name"), lambda: (m / "f2").write_bytes(b"x"),
               lambda: os.listdir(m), lambda: open(m / "f", "rb").read()):
        t0 = time.monotonic()
        with pytest.raises(OSError) as ei:
            op()
        took = time.monotonic() - t0
        assert ei.value.errno in (errno.EIO, errno.ENOENT), ei.value
        assert took < 5.0, f"call took {took:.1f}s with the master down"
    assert m.proc.poll() is None and os.path.ismount(m.path)
    c.start_master()
    c.wait_workers(1)
    wait_until(lambda: (m / "after").write_bytes(b"after"), 15, 0.2,
               message="mount did not recover after the master came back")
    assert (m / "after").read_bytes() == b"after"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_cleanly(cluster: LocalCluster, tmp_path: Path, sig: int) -> None:
    m = start_mount(tmp_path / "mnt", cluster.master, "--node-id", "node-1")
    try:
        (m / tmp_path.name).mkdir()
        (m / tmp_path.name / "f").write_bytes(b"kept")
        m.proc.send_signal(sig)
        assert m.proc.wait(15) == 0
        assert not is_mounted(m.path)
        assert cluster.client().get(f"/{tmp_path.name}/f") == b"kept"
    finally:
        m.stop()


def test_cli_errors(cluster: LocalCluster, tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "l2fs.cli", "mount", *args], capture_output=True,
                              text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                          if k != "L2FS_MASTER"})
    r = run(str(tmp_path))
    assert r.returncode == 2 and "--master" in r.stderr
    r = run(str(tmp_path / "missing"), "--master", cluster.master)
    assert r.returncode == 2 and "not a directory" in r.stderr
    r = run(str(tmp_path), "--master", cluster.master, "--cache-timeout", "5")
    assert r.returncode == 2 and "cache-timeout" in r.stderr
    # a mount whose daemon was SIGKILLed leaves a dead mountpoint: say so, and how to clear it
    dead = start_mount(tmp_path / "dead", cluster.master)
    try:
        dead.proc.kill()
        dead.proc.wait(10)
        r = run(str(dead.path), "--master", cluster.master)
        assert r.returncode == 2 and "fusermount3 -u" in r.stderr, r.stderr
    finally:
        dead.stop()
    assert not is_mounted(dead.path)


def test_root_subtree(cluster: LocalCluster, mount_factory: Callable[..., Mount], tmp_path: Path) -> None:
    m = mount_factory(cluster.master, "--node-id", "node-2", "--root", f"/{tmp_path.name}/tree")
    (m / "x").write_bytes(b"in subtree")
    os.mkdir(m / "d")
    os.rename(m / "x", m / "d" / "y")
    c = cluster.client()
    assert c.get(f"/{tmp_path.name}/tree/d/y") == b"in subtree"
    assert os.listdir(m) == ["d"]


def test_local_reads_short_circuit_remote_reads_stream(cluster: LocalCluster, two_mounts: tuple[Mount, Mount],
                                                       tmp_path: Path) -> None:
    """A block on node-1 is read from worker-1's disk by node-1's mount, and streamed over gRPC to node-2's."""
    m1, m2 = two_mounts
    d1 = _d(m1, tmp_path)
    data = os.urandom(4 << 20)
    (d1 / "blk").write_bytes(data)
    w1 = cluster.workers[0]
    assert w1.node_id == "node-1"
    streamed0 = metric(w1.metrics_port, "l2fs_worker_bytes_read_total")
    for _ in range(3):
        assert (d1 / "blk").read_bytes() == data
    assert metric(w1.metrics_port, "l2fs_worker_bytes_read_total") == streamed0, "node-1 mount streamed a local block"
    assert (m2 / tmp_path.name / "blk").read_bytes() == data
    assert metric(w1.metrics_port, "l2fs_worker_bytes_read_total") >= streamed0 + len(data)


def test_mount_over_a_volume_mount(cluster: LocalCluster, tmp_path: Path) -> None:
    """In a pod the mountpoint is often itself a volume (emptyDir/hostPath): mounting over it must work, and
    stopping must remove only the l2fs mount."""
    vol = tmp_path / "vol"
    vol.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "kvtier-test", str(vol)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        m = start_mount(vol, cluster.master, "--node-id", "node-1")
        try:
            assert mount_type(vol) == "fuse.l2fs"
            (m / "on-l2fs").write_bytes(b"x")
            assert cluster.client().get("/on-l2fs") == b"x"
        finally:
            m.stop()
        assert mount_type(vol) == "tmpfs" and not (vol / "on-l2fs").exists()
    finally:
        subprocess.run(["umount", str(vol)], capture_output=True)
