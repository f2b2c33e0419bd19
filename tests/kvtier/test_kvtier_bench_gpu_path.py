"""`kvtier bench gpu-path` (kvtier/bench/gpu_path.py) on a machine without a GPU (CI): `--device cpu --quick` must say that there is no CUDA,
still run the host part of every arm against a real l2fs master + worker, and print/write a well-formed table.
The CUDA half (pinned buffers, .to('cuda', non_blocking=True)) only runs on an NVIDIA machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_path_host_part_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "gpu_path.json"
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "gpu-path", "--device", "cpu", "--quick",
                        "--dir", str(tmp_path), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.startswith("NO CUDA: asked for --device cpu")
    res = json.loads(out.read_text())
    assert res["device"] == "cpu"
    arms = ["local file", "l2fs short-circuit", "l2fs data plane"]
    rows = res["rows"]
    assert [(x["chunk_bytes"], x["arm"]) for x in rows] == [(s << 20, a) for s in (1, 32) for a in arms]
    for x in rows:
        assert x["read_ms"] > 0 and x["read_gbps"] > 0 and x["copy_ms"] is None, x
        assert x["total_ms"] == x["read_ms"]
    assert all(x["total_vs_local"] == 1.0 for x in rows if x["arm"] == "local file")
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert len(table) == 2 + 6 and all(ln.count("|") == table[0].count("|") for ln in table)
    assert {x["arm"] for x in res["raw"]} == set(arms) and len(res["raw"]) == 2 * 3 * 3
    assert not list(tmp_path.glob("gpu-path-*"))  # scratch files and the local cluster's dirs are gone
