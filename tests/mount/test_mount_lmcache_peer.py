"""Peer suite: LMCache 0.5.6's own file-system storage tests, run unmodified against the mount.

The sdist is fetched at test time with pip (not vendored) and its tests/ cached under .kvtier/test-cache.
- tests/v1/storage_backend/test_fs_connector.py (the `fs://` remote connector) makes its storage dirs with
  tempfile.mkdtemp(): TMPDIR on the mount runs every test's remote through l2fs; the master's commit/rename
  counters prove the bytes went there.
- tests/v1/storage_backend/test_fs_native_connector.py (the C++ `lmcache_fs` client, O_DIRECT) uses pytest's
  tmp_path: --basetemp on the mount.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from mount_helpers import Mount, metric

from l2fs.testing.cluster import LocalCluster

pytest.importorskip("lmcache")
ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVTIER_TEST_CACHE", ROOT / ".kvtier" / "test-cache"))
PEER = "tests/v1/storage_backend/test_fs_connector.py"
NATIVE = "tests/v1/storage_backend/test_fs_native_connector.py"


def fetch_lmcache_tests(version: str = "0.5.6") -> Path:
    """tests/ + pytest.ini of the lmcache sdist, fetched with pip once and cached."""
    dest = CACHE / f"lmcache-{version}-tests"
    if (dest / PEER).exists():
        return dest
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        # The sdist's metadata build fails without its CUDA toolchain; --no-clean keeps the unpacked tree.
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-clean", "--no-deps", "--no-binary",
                            ":all:", "--no-build-isolation", "-d", tmp, f"lmcache=={version}"],
                           capture_output=True, text=True, timeout=600, env=dict(os.environ, TMPDIR=tmp))
        found = glob.glob(f"{tmp}/**/{PEER}", recursive=True)
        if not found:
            pytest.skip(f"could not fetch the lmcache {version} sdist: {r.stderr.strip()[-500:]}")
        src = Path(found[0]).parents[3]
        staged = Path(tmp) / "staged"
        shutil.copytree(src / "tests", staged / "tests")
        shutil.copy(src / "pytest.ini", staged / "pytest.ini")
        try:
            os.rename(staged, dest)
        except OSError:
            if not (dest / PEER).exists():  # another run won the race: fine; otherwise a real error
                raise
    return dest


def run_peer(peer: Path, test_file: str, tmpdir: Path, *extra: str) -> tuple[int, list[str], list[str], str]:
    env = dict(os.environ, TMPDIR=str(tmpdir), LMCACHE_TRACK_USAGE="false", PYTHONHASHSEED="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "not cuda", "-q", "-rA",
                        "--timeout", "120", "-o", "log_cli=false", *extra, test_file], cwd=peer, env=env,
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    passed = re.findall(r"^PASSED (\S+)", out, re.M)
    failed = re.findall(r"^(?:FAILED|ERROR|SKIPPED) (\S+.*)$", out, re.M)
    print(f"lmcache peer {test_file} (TMPDIR {tmpdir}): {len(passed)} passed, not passed: {failed}")
    return r.returncode, passed, failed, out


def test_lmcache_fs_connector_suite_on_mount(cluster: LocalCluster, mount_factory: Callable[..., Mount],
                                            tmp_path: Path) -> None:
    peer = fetch_lmcache_tests()
    m = mount_factory(cluster.master, "--node-id", "node-1")
    tmpdir = m / tmp_path.name / "peer-tmp"
    tmpdir.mkdir(parents=True)
    commits0 = metric(cluster.master_metrics_port, "l2fs_master_commits_total")
    renames0 = metric(cluster.master_metrics_port, "l2fs_master_rpc_seconds_count", method="Rename")
    rc, passed, failed, out = run_peer(peer, PEER, tmpdir)
    assert rc == 0 and len(passed) == 9 and not failed, out[-4000:]  # 9 tests in 0.5.6, all pass on ext4
    # the suite's data really went through l2fs: each put is a commit of key.tmp and a rename to key.data
    assert metric(cluster.master_metrics_port, "l2fs_master_commits_total") - commits0 >= 8
    assert metric(cluster.master_metrics_port, "l2fs_master_rpc_seconds_count", method="Rename") - renames0 >= 8
    leftovers = [n for n in os.listdir(tmpdir) if n.startswith("tmp")]
    assert not leftovers, f"the suite's cleanup (shutil.rmtree on the mount) left {leftovers} behind"


def test_lmcache_native_fs_client_suite_on_mount(cluster: LocalCluster, mount_factory: Callable[..., Mount],
                                                tmp_path: Path) -> None:
    peer = fetch_lmcache_tests()
    m = mount_factory(cluster.master, "--node-id", "node-2")
    (m / tmp_path.name).mkdir()
    base = m / tmp_path.name / "native"
    commits0 = metric(cluster.master_metrics_port, "l2fs_master_commits_total")
    rc, passed, failed, out = run_peer(peer, NATIVE, tmp_path, f"--basetemp={base}")
    assert rc == 0 and len(passed) == 2 and not failed, out[-4000:]  # 2 tests in 0.5.6, both pass on ext4
    assert metric(cluster.master_metrics_port, "l2fs_master_commits_total") - commits0 >= 1
