"""`kvtier bench local-put`: both same-node write paths run on a real cluster, each batch took the path its arm
names (the worker's own count of fds passed for writes), and every block read back equals what was put."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kvtier(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_bench_local_put_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _kvtier("bench", "local-put", "--quick", "--out", str(out), "--dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((out / "local_put.json").read_text())
    rows = doc["summary"]["rows"]
    assert [row["size"] for row in rows] == [64 << 10, 1 << 20]
    for row in rows:
        assert row["all_published"] and row["all_read_back_equal"], row
        # the memfd arm passed one fd per block (warm-up excluded), the data-plane arm none
        assert row["memfd_fd_writes"] >= row["blocks"] and row["data_plane_fd_writes"] == 0, row
        for arm in ("memfd", "data plane", "local file"):
            assert row[f"{arm}_s_p50"] > 0, arm
    assert {x["arm"] for x in doc["raw"]} == {"memfd", "data plane", "local file"}
    assert "memfd speed / data plane" in r.stdout


@pytest.mark.unit
def test_bench_local_put_bad_input() -> None:
    from kvtier.bench.local_put import main

    with pytest.raises(SystemExit) as e:
        main(["--sizes", "abc"])
    assert e.value.code == 2
    assert main(["--blocks", "0"]) == 2


def test_bench_l2fs_runs_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """`kvtier bench l2fs` prints its table and removes its scratch dir (the cluster's blocks; it used to leave
    ~1.2 GB in /tmp per run at the defaults)."""
    r = _kvtier("bench", "l2fs", "--iters", "1", "--size", str(1 << 20), "--dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "remote put (TCP data plane)" in r.stdout and "same-node get_into (short-circuit)" in r.stdout
    assert list(tmp_path.iterdir()) == []
