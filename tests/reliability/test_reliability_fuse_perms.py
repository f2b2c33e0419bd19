"""FUSE mount permissions, exercised as a real other user (uid 65534 via setpriv) on a real mount.

Without --allow-other nobody but the mounting user can touch the mount; with it, the kernel enforces
the modes the mount reports (default_permissions): others may read, never write, delete or rename.
A plain directory with the same modes is the control, so a denial is known to come from the mount.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from l2fs import fuse

FUSE_OK = os.path.exists("/dev/fuse") and os.geteuid() == 0 and bool(shutil.which("fusermount3")) and bool(
    shutil.which("setpriv"))
pytestmark = [pytest.mark.fuse, pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, root, fusermount3, setpriv")]

NOBODY = 65534
PROBE = r"""
import errno, json, os, sys
root, out = sys.argv[1], {}
def t(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
p = lambda n: os.path.join(root, n)
t("listdir", lambda: os.listdir(root))
t("read", lambda: open(p("f"), "rb").read())
t("write_new", lambda: open(p("new"), "wb").write(b"x"))
t("overwrite", lambda: open(p("f"), "r+b").write(b"x"))
t("unlink", lambda: os.unlink(p("f")))
t("mkdir", lambda: os.mkdir(p("d")))
t("rename", lambda: os.rename(p("f"), p("g")))
print(json.dumps(out))
"""


def _as_nobody(root: Path) -> dict[str, str]:
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        "/usr/bin/env", "python3", "-c", PROBE, str(root)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def cluster_options() -> dict[str, Any]:
    return {"name": "fuseperm", "workers": 1}


@pytest.fixture
def base() -> Iterator[Path]:
    """A world-traversable dir (pytest's tmp dirs are 0700, which would deny everyone by themselves)."""
    d = Path(tempfile.mkdtemp(prefix="kvtier-rel-fuse-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _mount(cluster: Any, mp: Path, *args: str) -> subprocess.Popen:
    return fuse.spawn(mp, cluster.master, "--node-id", "node-1", "--root", f"/perm{len(args)}", *args,
                      log=mp.parent / f"{mp.name}.log")


def _control(base: Path) -> Path:
    ctl = base / "control"
    ctl.mkdir(mode=0o755)
    (ctl / "f").write_bytes(b"secret")
    (ctl / "f").chmod(0o644)
    return ctl


def test_mount_without_allow_other_is_private(cluster: Any, base: Path) -> None:
    mp = base / "mnt"
    proc = _mount(cluster, mp)
    try:
        (mp / "f").write_bytes(b"secret")
        assert (mp / "f").read_bytes() == b"secret"
        got = _as_nobody(mp)
        assert got["listdir"] == "EACCES" and got["read"] == "EACCES", got
        assert all(v != "ok" for v in got.values()), got
        assert _as_nobody(_control(base))["read"] == "ok"  # the denial is the mount's, not the path's
        assert (mp / "f").read_bytes() == b"secret"
    finally:
        fuse.stop(proc, mp)


def test_allow_other_mount_is_read_only_for_others(cluster: Any, base: Path) -> None:
    mp = base / "mnt"
    proc = _mount(cluster, mp, "--allow-other")
    try:
        (mp / "f").write_bytes(b"secret")
        got = _as_nobody(mp)
        ctl = _as_nobody(_control(base))
        assert got["listdir"] == "ok" and got["read"] == "ok", got
        for op in ("write_new", "overwrite", "unlink", "mkdir", "rename"):
            assert got[op] == "EACCES", (op, got)
            assert ctl[op] == "EACCES", (op, ctl)  # same answer as a plain root-owned 0755/0644 dir
        assert (mp / "f").read_bytes() == b"secret"
        assert sorted(os.listdir(mp)) == ["f"]
    finally:
        fuse.stop(proc, mp)
