"""`kvtier bench l2 --quick`: every arm really stores and reads back the bytes (real l2fs, FUSE, Redis)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kvtier(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.fuse
def test_bench_l2_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _kvtier("bench", "l2", "--quick", "--out", str(out), "--dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((out / "l2.json").read_text())
    arms = res["summary"]["arms"][str(1 << 20)]
    assert set(arms) == {"local dir", "l2fs same node", "l2fs cross node", "l2fs mount", "redis"}
    for name, a in arms.items():
        assert a["read_gbps_p50"] > 0 and a["write_gbps_p50"] > 0, name
    # same-node objects were placed on node 1's worker (so the read is the short-circuit path)
    placed = {n for nodes in res["summary"]["placement"]["l2fs same node"] for n in nodes}
    assert placed == {"node-1"}, placed
    assert len([x for x in res["raw"] if x["arm"] == "redis"]) == 2
    assert "loopback TCP" in r.stdout and "read x local" in r.stdout
    # nothing left mounted or running under the scratch dir
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvtier-bench-l2-")]


def test_bench_bad_input() -> None:
    r = _kvtier("bench", "l2", "--sizes", "abc", timeout=60)
    assert r.returncode == 2 and "bad --sizes" in r.stderr
    r = _kvtier("bench", "nope", timeout=60)
    assert r.returncode == 2 and "unknown benchmark" in r.stderr
    r = _kvtier("bench", "cross-pod", "--lengths", "100", timeout=60)
    assert r.returncode == 2 and "every length" in r.stderr
