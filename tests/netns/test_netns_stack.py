"""`l2fs local --netns` as a user runs it: the real command in the foreground, a client in node-2 reads a
file node-1 wrote, over node-2's link; Ctrl-C removes the namespaces. Plus the option checks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from netns_helpers import launch_local, require_host, wait_line

from l2fs.testing.netns import NETNS_DIR, NetnsCluster

ROOT = Path(__file__).resolve().parents[2]
PY = [sys.executable, "-m", "l2fs.cli"]


@pytest.mark.timeout(180)
def test_l2fs_local_netns_node2_reads_node1_over_the_link(tmp_path: Path) -> None:
    require_host()
    proc = launch_local(tmp_path, 2)
    seen: list[str] = []
    try:
        m = wait_line(proc, r"master (\S+) .*namespaces (kvt[0-9a-f]{6})-\*.*Ctrl-C stops", seen)
        master, prefix = m.group(1), m.group(2)
        c = NetnsCluster.attach(prefix)
        assert master.startswith(c.ctl.addr + ":"), "the master is not bound to the control address"
        for n in c.nodes:
            assert re.search(rf"node={n.name} at {re.escape(n.addr)}:\d+ netns={n.netns}", "".join(seen))

        def l2fs(node: int, *args: str, data: bytes | None = None) -> bytes:
            r = c.run(node, [*PY, *args, "--master", master, "--node-id", f"node-{node}"], input=data,
                      check=False, cwd=ROOT, env={**os.environ, "L2FS_TOKEN": ""})
            assert r.returncode == 0, r.stderr
            return bytes(r.stdout)

        data = os.urandom(2 * 1024 * 1024 + 3)
        l2fs(1, "put", "-", "/x/blob", data=data)
        before = c.link_stats(2)
        assert l2fs(2, "cat", "/x/blob") == data
        assert c.link_stats(2)["rx_bytes"] - before["rx_bytes"] >= len(data), "node-2 read not over its link"
        assert proc.poll() is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)
    assert rc == 0, "".join(seen) + (proc.stdout.read() if proc.stdout else "")
    assert not [p for p in os.listdir(NETNS_DIR) if p.startswith(prefix)], "namespaces left after Ctrl-C"


@pytest.mark.unit
def test_link_without_netns_is_refused() -> None:
    r = subprocess.run([*PY, "local", "--link", "2gbit"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--link needs --netns" in r.stderr


@pytest.mark.timeout(180)
def test_l2fs_local_cleanup_removes_a_crashed_launchers_cluster(tmp_path: Path) -> None:
    """A launcher SIGKILLed while it holds namespaces: `l2fs local --cleanup` removes them."""
    require_host()
    proc = launch_local(tmp_path, 1)
    seen: list[str] = []
    try:
        prefix = wait_line(proc, r"namespaces (kvt[0-9a-f]{6})-\*", seen).group(1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the l2fs processes of its group
        proc.wait(timeout=30)
    assert [p for p in os.listdir(NETNS_DIR) if p.startswith(prefix)], "SIGKILL removed them: nothing to test"
    r = subprocess.run([*PY, "local", "--cleanup"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"{prefix}-ctl" in r.stdout
    assert not [p for p in os.listdir(NETNS_DIR) if p.startswith(prefix)]
