"""`kvtier chaos` as a user runs it: a cluster held by another process (`l2fs local --netns`, the same
launcher code as `kvtier up --netns`, without vLLM), found from an up.json, each fault applied through the
command and checked by what it does: reachability between the namespaces, the shaper's rate, the state of
node-1's worker process. Every fault is undone through the command as well."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_helpers import ROOT, echo_server, launch_local, reaches, require_host, wait_line, wait_reaches
from polling import wait_until

from l2fs.testing.netns import NETNS_DIR, NetnsCluster


def _proc_state(pid: int) -> str:
    """The process's state letter (R, S, T = stopped, Z), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def _states(pids: list[int], want: tuple[str, ...], timeout: float = 10.0) -> bool:
    """Whether every pid reaches one of the states (a signal takes effect when the process next runs)."""
    deadline = time.monotonic() + timeout
    while not all(_proc_state(p) in want for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.timeout(240)
def test_kvtier_chaos_on_a_cluster_held_by_another_process(tmp_path: Path) -> None:
    require_host()
    proc = launch_local(tmp_path, 2)
    seen: list[str] = []
    prefix = ""
    try:
        prefix = wait_line(proc, r"namespaces (kvt[0-9a-f]{6})-\*.*Ctrl-C stops", seen).group(1)
        up = tmp_path / "up.json"  # what `kvtier up --netns` writes, as far as chaos reads it
        up.write_text(json.dumps({"netns": {"prefix": prefix}}))

        def chaos(*args: str, where: list[str] | None = None) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "kvtier.cli", "chaos", *args,
                                   *(where if where is not None else ["--from-up", str(up)])],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60)

        def ok(*args: str) -> str:
            r = chaos(*args)
            assert r.returncode == 0, f"kvtier chaos {' '.join(args)}: {r.stderr}"
            return r.stdout

        def status() -> dict:
            return json.loads(ok("status"))["nodes"]

        c = NetnsCluster.attach(prefix)  # the test's own handle: sockets in the namespaces, never removes them
        n1, n2, ctl = echo_server(c, 1), echo_server(c, 2), echo_server(c, "ctl")

        # a partition between two nodes only: both still reach the control namespace (master, router)
        ok("partition", "node-1", "node-2")
        assert not reaches(c, 2, n1) and not reaches(c, 1, n2)
        assert reaches(c, 1, ctl) and reaches(c, 2, ctl)
        assert status()["node-1"]["cut_from"] == ["node-2 (blackhole)"]
        ok("heal", "1", "node-2")
        assert reaches(c, 2, n1) and status()["node-2"]["cut_from"] == []

        # link down: node-2 reaches nothing, node-1 is unaffected; link up: back
        ok("link-down", "node-2")
        assert not reaches(c, 2, ctl) and not reaches(c, 1, n2) and reaches(c, 1, ctl)
        assert status()["node-2"]["link"] == "down"
        ok("link-up", "node-2")
        assert wait_reaches(c, 1, n2) and status()["node-2"]["link"] == "up"

        # rate cut live, then removed
        ok("rate", "node-1", "50mbit")
        assert NetnsCluster.attach(prefix).rates["node-1"] == "50mbit" and status()["node-1"]["rate"] == "50mbit"
        ok("rate", "node-1", "none")
        assert NetnsCluster.attach(prefix).rates["node-1"] is None

        # bad input: exit 2 with the reason
        bad = chaos("link-down", "node-9")
        assert bad.returncode == 2 and "no namespace" in bad.stderr
        bad = chaos("link-down", "ctl")
        assert bad.returncode == 2 and "no link of its own" in bad.stderr
        bad = chaos("link-down", "node-1", where=["--cluster", "kvt000000"])
        assert bad.returncode == 2 and "no cluster of ours" in bad.stderr
        none = chaos("kill", "node-1", "--process", "mount")  # l2fs local mounts nothing
        assert none.returncode == 1 and "no process matched" in none.stdout

        # node-1's worker (the default --process): frozen, resumed, killed; node-2's worker untouched.
        # The kill comes last: `l2fs local` stops its whole cluster when a worker exits (`kvtier up` does not).
        [worker1] = c.pids(1, "l2fs.cli worker")
        [worker2] = c.pids(2, "l2fs.cli worker")
        assert str(worker1) in ok("stop", "node-1")
        assert _states([worker1], ("T",)) and _proc_state(worker2) != "T"
        ok("cont", "node-1")
        assert _states([worker1], ("R", "S"))
        assert proc.poll() is None, "the launcher died: " + "".join(seen)
        assert str(worker1) in ok("kill", "node-1")
        assert _states([worker1], ("Z", "gone"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    assert prefix and not [p for p in os.listdir(NETNS_DIR) if p.startswith(prefix)], "namespaces left"


@pytest.mark.parametrize("netns_cluster", [{"nodes": 1}], indirect=True)
def test_signal_pids_with_group_takes_the_leaders_whole_group(netns_cluster: NetnsCluster, tmp_path: Path) -> None:
    """What `kvtier chaos --process replica` relies on: the matched process's group comes along (a vLLM API
    server's engine core and workers), only when asked, and nothing outside the group."""
    c = netns_cluster
    leader = c.spawn(1, ["sh", "-c", "sleep 300 & sleep 300; : chaos-group-probe"], tmp_path / "g.log")
    other = c.popen(1, ["sleep", "301"])
    # both children exec'ed: the leader's own command line says "sleep 300" too, and a child forked but not yet
    # exec'ed still carries the leader's (probe included)
    wait_until(lambda: len(c.pids(1, "sleep 300")) >= 3 and c.pids(1, "chaos-group-probe") == [leader.pid], 10,
               message="the group's children did not start")
    assert c.signal_pids(1, signal.SIGSTOP, "chaos-group-probe") == [leader.pid]
    stopped = c.signal_pids(1, signal.SIGSTOP, "chaos-group-probe", group=True)
    assert len(stopped) == 3 and leader.pid in stopped and other.pid not in stopped
    assert _states(stopped, ("T",)) and _proc_state(other.pid) != "T"
    c.signal_pids(1, signal.SIGCONT, "chaos-group-probe", group=True)
    assert _states(stopped, ("R", "S"))
