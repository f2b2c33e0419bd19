"""Stock LMCache 0.5.6 on the mount: chunks stored through node 1's mount come back byte-exact through node 2's.

No plugin: LMCache's own `fs://` remote connector (write key.tmp, os.replace to key.data, readinto) is pointed
at the FUSE mount, exactly as the reference design hands it a path on a Curvine mount.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mount_helpers import Mount

from l2fs.testing.cluster import LocalCluster

pytest.importorskip("lmcache")
DRIVER = Path(__file__).with_name("mount_lmc_driver.py")
N = 24


def _drive(mode: str, base: Path, n: int) -> dict:
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", PYTHONHASHSEED="0")
    r = subprocess.run([sys.executable, str(DRIVER), mode, str(base), str(n)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_lmcache_store_node1_retrieve_node2(cluster: LocalCluster, two_mounts: tuple[Mount, Mount],
                                            tmp_path: Path) -> None:
    m1, m2 = two_mounts
    rel = f"{tmp_path.name}/l2cache/tiny"
    stored = _drive("store", m1 / rel, N)
    assert stored["stored"] == N and stored["tmp_left"] == 0, stored
    assert "RemoteBackend" in stored["backends"]
    # the chunks really are l2fs files, placed on node 1 (local-first), one per key
    c = cluster.client()
    infos = [i for i in c.ls(f"/{rel}") if i.path.endswith(".data")]
    assert len(infos) == N
    assert {n for i in infos for n in i.nodes} == {"node-1"}
    assert all(i.size > 1 << 20 for i in infos)  # 1 MiB of KV + LMCache's chunk metadata
    got = _drive("retrieve", m2 / rel, N)
    assert got == {"exact": N, "wrong": 0, "missing": 0, "get_s": got["get_s"], "backends": got["backends"]}
    # a chunk removed from L2 is a clean miss for LMCache, not an error or a hang
    c.rm(infos[0].path)
    got = _drive("retrieve", m2 / rel, N)
    assert got["missing"] == 1 and got["exact"] == N - 1 and got["wrong"] == 0
