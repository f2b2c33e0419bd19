"""`l2fs mount --passthrough` read-write: writes go through FUSE passthrough into a node-local temp file and
are published at close/fsync with the client's put (writer's CRC32C, quotas, size-bound capabilities, seal).
Real processes: a LocalCluster (node-1, node-2), passthrough mounts as node-1 and node-2, stock LMCache; the
server's counters (--metrics-port) show that no WRITE request reached it."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_mount_passthrough
from mount_helpers import start_mount
from polling import wait_until
from test_mount_passthrough import PtMount

from l2fs.common import crc32c_fast
from l2fs.testing.cluster import LocalCluster

MIB = 1 << 20
pt_mount = test_mount_passthrough.pt_mount  # the fixture
DRIVER = Path(__file__).with_name("mount_lmc_driver.py")


@pytest.fixture(scope="module")
def cluster_options() -> dict[str, Any]:
    """Two 2 GiB workers; /quota may hold 1 MiB."""
    return {"capacity": "2G", "master_args": ["--prefix-quota", "/quota=1MiB"]}


def test_writes_publish_and_read_back_on_both_nodes(cluster: LocalCluster, pt_mount: Callable[..., PtMount],
                                                    tmp_path: Path) -> None:
    """New files of 0 B to 17 MiB written through node-1's mount: the kernel wrote the temp files itself (no
    WRITE request), each close published the bytes with their own CRC32C on node-1's worker, and node-2's mount
    and the native client read them back identical."""
    m1, m2 = pt_mount(cluster.master, "node-1"), pt_mount(cluster.master, "node-2")
    os.mkdir(m1 / "w")
    files = {f"w/f{size}.bin": os.urandom(size) for size in (0, 1000, MIB, 17 * MIB + 3)}
    for rel, d in files.items():
        with open(m1 / rel, "wb") as f:
            f.write(d)
    assert m1.count("write_opens_passthrough") == len(files)
    assert m1.count("write_requests") == 0  # the kernel wrote the backing files itself
    assert m1.count("publishes") == len(files)
    c = cluster.client()
    for rel, d in files.items():
        info = c.stat("/" + rel)
        assert info.size == len(d) and info.crc32c == crc32c_fast(d) and info.nodes == ["node-1"], rel
        assert c.get("/" + rel) == d
        with open(m2 / rel, "rb") as f:
            assert f.read() == d, rel
        with open(m1 / rel, "rb") as f:
            assert f.read() == d, rel
    assert sorted(os.listdir(m2 / "w")) == sorted(p.split("/")[1] for p in files)
    assert m1.count("read_requests") == 0 and m2.count("read_requests") == 0


def test_overwrite_rename_unlink_truncate(cluster: LocalCluster, pt_mount: Callable[..., PtMount]) -> None:
    """The pyfuse3 mount's semantics: in-place overwrite and append keep the other bytes, O_TRUNC replaces,
    truncate(path) and ftruncate publish the cut, rename moves (NOREPLACE and onto a directory fail), unlink and
    rmdir remove, a file still open is visible on its own mount only, and the last close of two writers wins."""
    m1, m2 = pt_mount(cluster.master, "node-1"), pt_mount(cluster.master, "node-2")
    c = cluster.client()
    os.mkdir(m1 / "s")
    base = os.urandom(2 * MIB)
    (m1 / "s/a").write_bytes(base)
    with open(m1 / "s/a", "r+b") as f:  # overwrite in place, at once (same size, same mtime tick)
        f.seek(100)
        f.write(b"poison")
    want = base[:100] + b"poison" + base[106:]
    assert c.get("/s/a") == want and (m2 / "s/a").read_bytes() == want
    with open(m1 / "s/a", "ab") as f:
        f.write(b"tail")
    assert c.get("/s/a") == want + b"tail"
    os.truncate(m1 / "s/a", 10)
    assert c.get("/s/a") == want[:10]
    with open(m1 / "s/a", "r+b") as f:
        f.truncate(4)
    assert c.get("/s/a") == want[:4] and os.stat(m2 / "s/a").st_size == 4
    (m1 / "s/a").write_bytes(b"new")  # O_TRUNC
    assert c.get("/s/a") == b"new"

    f = open(m1 / "s/open.bin", "wb")  # noqa: SIM115 - kept open on purpose
    f.write(b"x" * 5000)
    f.flush()
    assert os.stat(m1 / "s/open.bin").st_size == 5000 and "open.bin" in os.listdir(m1 / "s")
    assert not c.exists("/s/open.bin")  # not published before its close
    with pytest.raises(FileNotFoundError):
        os.stat(m2 / "s/open.bin")
    f.close()
    assert c.get("/s/open.bin") == b"x" * 5000

    w1 = open(m1 / "s/race", "wb")  # noqa: SIM115
    w1.write(b"1" * 3000)
    w1.flush()
    with pytest.raises(OSError) as e:  # one backing file per inode: a second writer on this node waits its turn
        open(m1 / "s/race", "r+b")
    assert e.value.errno == errno.EIO  # the kernel's answer to a second backing file
    w2 = open(m2 / "s/race", "wb")  # noqa: SIM115 - another node: its own temp file
    w2.write(b"2" * 2000)
    w2.close()
    assert c.get("/s/race") == b"2" * 2000
    with open(m1 / "s/race", "rb") as r:  # a reader here shares the writer's file: this mount's newer bytes
        assert r.read() == b"1" * 3000
    w1.close()  # the last close wins, never a mix
    assert c.get("/s/race") == b"1" * 3000
    (m1 / "s/held").write_bytes(b"v1" * 100)
    with open(m1 / "s/held", "rb") as r:  # no write through a reader's backing file (the sealed block)
        with pytest.raises(OSError) as e:
            open(m1 / "s/held", "r+b")
        assert e.value.errno == errno.EIO
        (m2 / "s/held").write_bytes(b"v2" * 100)  # a new version from another node
        assert r.read() == b"v1" * 100
        # once the kernel's entry expires, an open here gets the new version on a new inode (it was EIO: the
        # kernel refuses an open without the inode's backing file)
        wait_until(lambda: (m1 / "s/held").read_bytes() == b"v2" * 100, timeout=10)
    assert c.get("/s/held") == b"v2" * 100

    os.replace(m1 / "s/open.bin", m1 / "s/moved.bin")  # LMCache's publish: key.tmp -> key.data
    assert c.get("/s/moved.bin") == b"x" * 5000 and not c.exists("/s/open.bin")
    assert (m2 / "s/moved.bin").read_bytes() == b"x" * 5000
    os.replace(m1 / "s/race", m1 / "s/moved.bin")  # over an existing file
    assert c.get("/s/moved.bin") == b"1" * 3000
    os.mkdir(m1 / "s/dir")
    with pytest.raises(OSError) as e:
        os.rename(m1 / "s/moved.bin", m1 / "s/dir")
    assert e.value.errno in (errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY, errno.EINVAL)
    with pytest.raises(FileExistsError):
        os.mkdir(m1 / "s/dir")
    os.unlink(m1 / "s/moved.bin")
    assert not c.exists("/s/moved.bin")
    with pytest.raises(FileNotFoundError):
        os.unlink(m1 / "s/moved.bin")
    with pytest.raises(FileNotFoundError):
        open(m1 / "s/missing", "r+b")
    os.rmdir(m1 / "s/dir")
    assert not c.exists("/s/dir")
    g = open(m1 / "s/gone", "wb")  # noqa: SIM115 - unlinked while open: never published
    g.write(b"z" * 100)
    os.unlink(m1 / "s/gone")
    g.close()
    assert not c.exists("/s/gone")


def test_lmcache_stores_through_node1_and_node2_loads(cluster: LocalCluster, pt_mount: Callable[..., PtMount],
                                                      tmp_path: Path) -> None:
    """Stock LMCache 0.5.6's fs:// connector (key.tmp written, os.replace to key.data) through node-1's
    passthrough mount; another LMCache reads every chunk back byte-exact through node-2's."""
    pytest.importorskip("lmcache")
    # a 10 s client deadline: a cross-node fetch past the default 2 s is a miss by design (the mount's log says
    # so), and on a loaded 2-core box one of 8 once was; this test is about the bytes, not the deadline
    m1, m2 = (pt_mount(cluster.master, n, "--timeout", "10") for n in ("node-1", "node-2"))
    rel = f"{tmp_path.name}/l2cache/tiny"
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", PYTHONHASHSEED="0")

    def drive(mode: str, m: PtMount) -> dict:
        r = subprocess.run([sys.executable, str(DRIVER), mode, str(m / rel), "8"], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    os.makedirs(m1 / rel)
    stored = drive("store", m1)
    assert stored["stored"] == 8 and stored["tmp_left"] == 0, stored
    assert m1.count("write_opens_passthrough") >= 8 and m1.count("write_requests") == 0
    infos = [i for i in cluster.client().ls(f"/{rel}") if i.path.endswith(".data")]
    assert len(infos) == 8 and {n for i in infos for n in i.nodes} == {"node-1"}
    got = drive("retrieve", m2)
    assert (got["exact"], got["wrong"], got["missing"]) == (8, 0, 0), got


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, b"torn" * 65536)
    os.kill(os.getpid(), signal.SIGKILL)  # dies with the file open: the kernel closes it (FLUSH) in do_exit
""")


def test_killed_writer_publishes_nothing(cluster: LocalCluster, pt_mount: Callable[..., PtMount]) -> None:
    """A writer SIGKILLed mid-write: a new file is never published, an existing one keeps its old bytes."""
    m1 = pt_mount(cluster.master, "node-1")
    c = cluster.client()
    os.makedirs(m1 / "k", exist_ok=True)
    (m1 / "k/old").write_bytes(b"old" * 1000)
    for name in ("new", "old"):
        r = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(m1 / f"k/{name}")], timeout=60)
        assert r.returncode == -9
    assert not c.exists("/k/new")
    assert c.get("/k/old") == b"old" * 1000
    assert m1.count("publishes_discarded") == 2
    with pytest.raises(FileNotFoundError):
        os.stat(m1 / "k/new")


def test_bounds_and_bad_input(cluster: LocalCluster, pt_mount: Callable[..., PtMount]) -> None:
    """A file past --max-file-size, or past its prefix's quota, fails its close (EFBIG / EDQUOT) and publishes
    nothing; names too long or with bad bytes get clear errnos; a --read-only mount refuses writes (EROFS)."""
    m1 = pt_mount(cluster.master, "node-1", "--max-file-size", "1M")
    c = cluster.client()
    os.makedirs(m1 / "b", exist_ok=True)
    f = open(m1 / "b/big", "wb")  # noqa: SIM115
    f.write(b"x" * (MIB + 1))
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno == errno.EFBIG
    assert not c.exists("/b/big")
    (m1 / "b/fits").write_bytes(b"y" * MIB)
    assert c.get("/b/fits") == b"y" * MIB
    with pytest.raises(OSError) as e:
        os.truncate(m1 / "b/fits", MIB + 1)
    assert e.value.errno == errno.EFBIG
    assert c.get("/b/fits") == b"y" * MIB
    os.makedirs(m1 / "quota", exist_ok=True)
    (m1 / "quota/a").write_bytes(b"q" * (600 << 10))
    f = open(m1 / "quota/b", "wb")  # noqa: SIM115
    f.write(b"q" * (600 << 10))
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno == errno.EDQUOT
    assert not c.exists("/quota/b") and c.get("/quota/a") == b"q" * (600 << 10)
    with pytest.raises(OSError) as e:
        open(m1 / ("b/" + "n" * 256), "wb")
    assert e.value.errno == errno.ENAMETOOLONG
    ro = pt_mount(cluster.master, "node-1", "--read-only")
    for attempt in (lambda: open(ro / "b/ro", "wb"), lambda: os.mkdir(ro / "b/d"), lambda: os.unlink(ro / "b/fits"),
                    lambda: os.truncate(ro / "b/fits", 0)):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS
    assert c.get("/b/fits") == b"y" * MIB


def test_process_writes_fallback(cluster: LocalCluster, pt_mount: Callable[..., PtMount]) -> None:
    """--process-reads (the path without passthrough): writes arrive as WRITE requests, same bytes published."""
    m = pt_mount(cluster.master, "node-2", "--process-reads")
    os.makedirs(m / "p", exist_ok=True)
    d = os.urandom(3 * MIB + 5)
    (m / "p/f").write_bytes(d)
    assert m.count("write_requests") > 0 and m.count("write_opens_passthrough") == 0
    c = cluster.client()
    assert c.get("/p/f") == d and c.stat("/p/f").nodes == ["node-2"]
    assert (m / "p/f").read_bytes() == d


def test_non_root_writer(cluster: LocalCluster, tmp_path: Path) -> None:
    """--uid 1000 --gid 1000 (a vLLM container's user): uid 1000 makes a directory, writes, renames and reads
    back; uid 1001 reads but cannot create (the kernel enforces the modes)."""
    with tempfile.TemporaryDirectory(prefix="l2fs-pt-owner-", dir="/tmp", ignore_cleanup_errors=True) as top:
        os.chmod(top, 0o755)  # pytest's tmp_path is root-only
        m = start_mount(Path(top) / "m", cluster.master, "--passthrough", "--node-id", "node-1", "--uid", "1000",
                        "--gid", "1000", "--cache-dir", str(tmp_path))
        try:
            def as_user(uid: int, script: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run(["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "sh",
                                       "-c", script], capture_output=True, text=True, timeout=60)

            d = m / "owned"
            r = as_user(1000, f"mkdir {d} && printf hi > {d}/a.tmp && mv {d}/a.tmp {d}/a && cat {d}/a")
            assert (r.returncode, r.stdout) == (0, "hi"), r.stderr
            r = as_user(1001, f"cat {d}/a && printf x > {d}/b")
            assert r.returncode != 0 and r.stdout == "hi" and "Permission denied" in r.stderr
        finally:
            m.stop()
    c = cluster.client()
    assert c.get("/owned/a") == b"hi" and not c.exists("/owned/b")

@pytest.mark.unit
def test_one_argument_list_starts_either_mount(tmp_path: Path) -> None:
    """The deployed mount's flags (as the mount DaemonSet and an endpoint supervisor's children pass them) are
    accepted by the passthrough server's own parser too, so selecting it is adding --passthrough."""
    import importlib

    from l2fs.fuse import passthrough

    pyfuse3_main = importlib.import_module("l2fs.fuse.main")  # the package re-exports main(), hiding the module

    argv = [str(tmp_path), "--master", "10.0.0.5:8995", "--node-id", "n1", "--timeout", "2", "--allow-other",
            "--uid", "1000", "--gid", "1000", "--umask", "002", "--max-file-size", "64M", "--write-buffer", "128M",
            "--read-cache", "256M", "--page-cache", "--cache-timeout", "1", "--threads", "8"]
    pyfuse3_main.parse_args(argv)
    a = passthrough.parse_args([*argv, "--passthrough"])
    assert (a.uid, a.gid, a.umask, a.max_file_size, a.read_only) == (1000, 1000, 0o002, 64 << 20, False)
    assert passthrough.parse_args([*argv, "--read-only"]).read_only


@pytest.mark.fuse
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
def test_passthrough_auto_probes_the_kernel_and_falls_back_to_pyfuse3(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--endpoints --passthrough=auto` (the mount DaemonSet's default): the kernel's own INIT offer decides,
    read from a throwaway mount that is gone afterwards; where it is not offered (or no FUSE mount can be made)
    the children are pyfuse3 mounts and the passthrough-only cache flags are dropped, with the reason logged."""
    import importlib

    from l2fs.fuse import endpoints, kernel

    main = importlib.import_module("l2fs.fuse.main")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the probe's scratch directory goes
    (tmp_path / "eps").mkdir()
    argv = [str(tmp_path), "--master", "10.0.0.5:8995", "--endpoints", str(tmp_path / "eps"),
            "--passthrough=auto", "--cache-dir", str(tmp_path), "--cache-size", "1G"]
    offered = kernel.passthrough_offered(str(tmp_path))  # this kernel, for real (needs root and /dev/fuse)
    assert "l2fs-probe" not in Path("/proc/self/mounts").read_text()
    a = main.parse_args(argv)
    main.resolve_auto_passthrough(a)
    assert ("--passthrough" in endpoints.child_args(a)) == offered
    for probe in (lambda _: False, lambda _: (_ for _ in ()).throw(PermissionError(1, "mount: not permitted"))):
        monkeypatch.setattr(kernel, "passthrough_offered", probe)
        a = main.parse_args(argv)
        main.resolve_auto_passthrough(a)
        child = endpoints.child_args(a)
        assert a.passthrough is None and "--passthrough" not in child and "--cache-dir" not in child, child
        main.parse_args(child + [str(tmp_path)])  # what the pyfuse3 child gets, its own parser takes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("l2fs-probe-")]


def test_endpoint_mounts_with_passthrough(tmp_path: Path, make_cluster: Callable[..., LocalCluster]) -> None:
    """`l2fs mount --endpoints DIR --passthrough --cache-dir D` (the mount DaemonSet's per-endpoint command with
    the passthrough server) on two nodes of a real cluster: each endpoint's mount is a passthrough server (its
    open writer's backing file is an unlinked temp file in its own private directory under D), a file written
    through ep-a's mount on node-1 is read back identical through ep-a's mount on node-2, lands under ep-a's
    prefix only, and ep-b's mounts do not show it. Before, `--endpoints` with `--passthrough` was refused."""
    import psutil

    from l2fs.fuse.main import mount_type
    from l2fs.procs import spawn, stop

    kv, admin, master = "/kvtier/kv", "admin-token-0123456789abcdef", "master-token-0123456789abcdef"
    eps = ("ep-a", "ep-b")
    entries = [
        {"name": "master", "token": master, "role": "worker"}, {"name": "ops", "token": admin, "role": "admin"},
        *[{"name": f"mount-{e}", "token": f"mount-{e}-token-0123456789", "role": "mount",
           "prefixes": [f"{kv}/{e}"]} for e in eps]]
    src = tmp_path / "endpoint-mounts"
    src.mkdir()
    for e in eps:
        (src / e).write_text(json.dumps({"root": f"{kv}/{e}", "token": f"mount-{e}-token-0123456789"}))
    sups: dict[str, Any] = {}
    c = make_cluster(2, capacity="512M", token=admin, tokens=entries, master_args=["--token", master],
                     worker_args=["--token", master])
    try:  # each endpoint's prefix does not exist yet: its mount makes it
        for node in ("node-1", "node-2"):
            (tmp_path / f"cache-{node}").mkdir()
            (tmp_path / f"mnt-{node}").mkdir()
            sups[node] = spawn([sys.executable, "-m", "l2fs.cli", "mount", str(tmp_path / f"mnt-{node}"),
                                "--endpoints", str(src), "--passthrough", "--cache-dir",
                                str(tmp_path / f"cache-{node}"), "--endpoints-poll", "0.3", "--master",
                                c.master, "--node-id", node], tmp_path / f"sup-{node}.log")
        mnt = {n: tmp_path / f"mnt-{n}" for n in sups}

        def at(n: str, e: str) -> Path:  # endpoint e's mount on node n: inside its plain node directory
            return mnt[n] / e / e

        wait_until(lambda: all(mount_type(at(n, e)) == "fuse.l2fs" for n in sups for e in eps), 30)
        logs = {n: (tmp_path / f"sup-{n}.log") for n in sups}
        wait_until(lambda: all(logs[n].read_text().count("passthrough ") >= 2 for n in sups), 15)
        if any("passthrough off" in logs[n].read_text() for n in sups):
            pytest.skip("the kernel grants no FUSE passthrough (needs Linux >= 6.9, CONFIG_FUSE_PASSTHROUGH)")
        data = os.urandom(3 * MIB + 5)
        cache = tmp_path / "cache-node-1"
        with open(at("node-1", "ep-a") / "chunk.data", "wb") as f:
            f.write(data)
            f.flush()
            backing = [link for p in psutil.Process(sups["node-1"].pid).children()
                       for fd in os.listdir(f"/proc/{p.pid}/fd")
                       if (link := _readlink(f"/proc/{p.pid}/fd/{fd}")).startswith(str(cache))]
        # the open writer's backing file: an unlinked temp file in one endpoint mount's private directory
        # (each endpoint's passthrough server has its own)
        assert len(list(cache.glob("l2fs-pt-*"))) == 2, list(cache.iterdir())
        assert [b for b in backing if b.endswith(" (deleted)")], backing
        assert (at("node-2", "ep-a") / "chunk.data").read_bytes() == data  # the other node, same endpoint
        with c.client(token=admin) as a:
            info = a.stat(f"{kv}/ep-a/chunk.data")
            assert info.size == len(data) and info.crc32c == crc32c_fast(data) and info.nodes == ["node-1"]
            assert a.ls(f"{kv}/ep-b") == []
        assert os.listdir(at("node-1", "ep-b")) == [] and os.listdir(at("node-2", "ep-b")) == []
        (at("node-2", "ep-b") / "b.data").write_bytes(b"b" * 1000)
        with c.client(token=admin) as a:
            assert a.get(f"{kv}/ep-b/b.data") == b"b" * 1000 and a.stat(f"{kv}/ep-a/b.data") is None
    finally:
        for p in sups.values():
            stop(p)
    assert all(mount_type(tmp_path / f"mnt-{n}" / e / e) is None for n in sups for e in eps)


def _readlink(p: str) -> str:
    try:
        return os.readlink(p)
    except OSError:
        return ""
