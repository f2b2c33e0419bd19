"""A tiny-duration run of `kvtier bench load` (kvtier/bench/l2fs_load.py; the 60 s run is the benchmark, not a test).

Checks the script end to end against a real local cluster: every op type ran, no errors, no call past
the client deadline, and no process grew by more than a loose bound in a short run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from reliability_faults import DEADLINE

ROOT = Path(__file__).resolve().parents[2]


def test_load_script_short_run(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "load", "--duration", "3", "--clients", "4",
         "--procs", "2", "--chains", "8", "--warm-chains", "8", "--size", "32K", "--timeout", str(DEADLINE),
         "--json", str(out)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    table = proc.stdout
    assert "p99 ms" in table and "growth MiB" in table
    assert res["errors"] == 0, res["error_samples"]
    for op, r in res["ops"].items():
        assert r["count"] > 0, f"no {op} ran"
        assert r["max_ms"] <= DEADLINE * 1e3 * 1.5, f"{op} took {r['max_ms']:.0f} ms"
    gets = res["ops"]["get"]["count"]
    assert res["misses"] < gets, "every get missed although all chains were written before the run"
    assert set(res["memory"]) >= {"master", "worker node-1", "worker node-2"}
    for name, m in res["memory"].items():
        assert m["growth_mb"] < 64, f"{name} grew {m['growth_mb']:.1f} MiB in 3 s"
