"""Non-root writers: `l2fs mount --uid/--gid/--umask` lets a non-root process (a vLLM
container's user) write the mount, and the kernel keeps out the users the umask excludes. The writers are
real processes under other uids (setpriv)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from mount_helpers import Mount, start_mount

from l2fs.testing.cluster import LocalCluster

pytestmark = pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is root-only 0700)."""
    with tempfile.TemporaryDirectory(prefix="l2fs-owner-", dir="/tmp", ignore_cleanup_errors=True) as d:
        os.chmod(d, 0o755)
        yield Path(d)


def as_user(uid: int, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `sh -c script` as uid:uid with no supplementary groups."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c", script,
                           "sh", *args], capture_output=True, text=True, timeout=30)


WRITE_READ = 'printf "$2" > "$1" && cat "$1"'


def test_non_root_owner_writes_others_cannot(cluster: LocalCluster, open_dir: Path) -> None:
    m: Mount = start_mount(open_dir / "mnt", cluster.master, "--node-id", "node-1", "--uid", "1000",
                           "--gid", "1000", "--umask", "022", "--root", "/owner1")
    try:
        s = os.stat(m.path)
        assert (s.st_uid, s.st_gid, s.st_mode & 0o777) == (1000, 1000, 0o755)
        r = as_user(1000, WRITE_READ, str(m / "kv.data"), "from-uid-1000")
        assert r.returncode == 0 and r.stdout == "from-uid-1000", r.stderr
        r = as_user(1000, 'mkdir "$1" && printf x > "$1/c" && mv "$1/c" "$1/d" && cat "$1/d"', str(m / "sub"))
        assert r.returncode == 0 and r.stdout == "x", r.stderr
        f = os.stat(m / "kv.data")
        assert (f.st_uid, f.st_gid, f.st_mode & 0o777) == (1000, 1000, 0o644)
        # uid 1001 is neither owner nor in the group: it reads, but the umask forbids it to write
        r = as_user(1001, 'cat "$1"', str(m / "kv.data"))
        assert r.returncode == 0 and r.stdout == "from-uid-1000", r.stderr
        r = as_user(1001, WRITE_READ, str(m / "intruder"), "x")
        assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr
        r = as_user(1001, 'printf x > "$1"', str(m / "kv.data"))
        assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr
        r = as_user(1001, 'rm -f "$1"', str(m / "kv.data"))
        assert r.returncode != 0, r.stderr
        assert (m / "kv.data").read_text() == "from-uid-1000"
        assert not (m / "intruder").exists()
    finally:
        m.stop()
    c = cluster.client()
    assert c.get("/owner1/kv.data") == b"from-uid-1000" and c.get("/owner1/sub/d") == b"x"
    c.close()


def test_umask_000_lets_every_user_write(cluster: LocalCluster, open_dir: Path) -> None:
    m = start_mount(open_dir / "mnt", cluster.master, "--uid", "1000", "--gid", "1000", "--umask", "000",
                    "--root", "/owner2")
    try:
        assert os.stat(m.path).st_mode & 0o777 == 0o777
        r = as_user(1001, WRITE_READ, str(m / "shared"), "from-uid-1001")
        assert r.returncode == 0 and r.stdout == "from-uid-1001", r.stderr
    finally:
        m.stop()


def test_default_mount_is_root_only_for_writes(cluster: LocalCluster, open_dir: Path) -> None:
    """Without the flags nothing changes: root owns everything, other users cannot even enter."""
    m = start_mount(open_dir / "mnt", cluster.master, "--root", "/owner3")
    try:
        assert os.stat(m.path).st_uid == 0
        r = as_user(1000, WRITE_READ, str(m / "x"), "x")
        assert r.returncode != 0, r.stdout
    finally:
        m.stop()


@pytest.mark.unit
def test_owner_and_memory_options_parse(tmp_path: Path) -> None:
    """The new flags' values and refusals (in process: parse_args only)."""
    from l2fs.fuse import parse_args

    a = parse_args([str(tmp_path), "--master", "h:1", "--umask", "0027", "--uid", "1000", "--max-file-size", "1M"])
    assert (a.umask, a.uid, a.gid, a.max_file_size, a.write_buffer) == (0o027, 1000, None, 1 << 20, 2 << 20)
    for bad in (["--umask", "8"], ["--umask", "1777"], ["--write-buffer", "lots"], ["--max-file-size", "0"]):
        with pytest.raises(SystemExit):
            parse_args([str(tmp_path), "--master", "h:1", *bad])
