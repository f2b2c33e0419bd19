"""`kvtier bench l2 --netns`: the benchmark runs over a shaped node link, reports the link's own TCP
throughput next to its arms, and leaves no namespaces behind; its argument errors are clear exits 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from netns_helpers import require_host

from l2fs.testing.netns import _our_namespaces

KVTIER = [sys.executable, "-m", "kvtier.cli"]


def test_bench_l2_netns_quick(tmp_path: Path) -> None:
    require_host()
    r = subprocess.run([*KVTIER, "bench", "l2", "--netns", "--link", "500mbit", "--quick", "--no-redis",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "link TCP node-1 -> node-2 (1 stream)" in r.stdout
    assert "(link 500mbit): plain TCP" in r.stdout
    summary = json.loads((tmp_path / "l2.json").read_text())["summary"]
    assert summary["link"] == "500mbit" and summary["netns"] is True
    # 500 mbit binds on any machine that runs this suite: the measured TCP is the shaper's rate, not loopback's
    assert summary["shaper_bound"] is True, summary["link_tcp_gbit"]
    arms = summary["arms"][str(1 << 20)]
    assert {"l2fs same node", "l2fs cross node", "l2fs mount"} <= set(arms)
    assert arms["l2fs cross node"]["read_vs_link_tcp"] > 0
    # the cross-node objects were written on node-1 and read by node-2 through the link
    assert {n for ns in summary["placement"]["l2fs cross node"] for n in ns} == {"node-1"}
    # its own namespaces (by its prefix: other launchers may run in parallel) are gone
    prefix = re.search(r"namespaces (kvt[0-9a-f]{6})-\*", r.stdout + r.stderr)
    assert prefix, r.stdout + r.stderr
    assert prefix.group(1) not in _our_namespaces(), "the bench left namespaces behind"


@pytest.mark.unit
@pytest.mark.parametrize(("args", "message"), [
    (["l2", "--link", "2gbit"], "--link needs --netns"),
    (["l2", "--netns", "--link", "fast"], "bad rate 'fast'"),
    (["cross-pod", "--link", "2gbit"], "--link needs --netns"),
    (["cross-pod", "--netns", "--link", "fast"], "bad rate 'fast'"),
    (["cross-pod", "--from-up", "up.json", "--netns"], "--from-up reads them from up.json"),
    (["cross-pod", "--replica-a", "http://a", "--replica-b", "http://b", "--mode", "mount"],
     "are for a stack started here"),
])
def test_bench_argument_errors(args: list[str], message: str) -> None:
    """Exit 2 with a clear message before anything (namespaces, l2fs, vLLM) is started."""
    r = subprocess.run([*KVTIER, "bench", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
