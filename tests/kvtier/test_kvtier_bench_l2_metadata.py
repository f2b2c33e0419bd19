"""`kvtier bench l2 --metadata`: the master-rate benchmark runs end to end on real l2fs processes (its
sharded arm on the product's sharded masters; their routing is tested in tests/l2fs/test_l2fs_shards.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _kvtier(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_bench_l2_metadata_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # --scoped: the per-size cluster as deployed (a scoped tokens file, the clients an engine token); the
    # sharded arms without authentication
    r = _kvtier("bench", "l2", "--metadata", "--quick", "--scoped", "--out", str(out), "--dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "l2_metadata.json").read_text())["summary"]
    [row] = summary["sizes"]
    assert row["scoped"] is True
    assert row["files"] == 400 and row["published"] == 400 and row["put_errors"] == 0 and row["stat_errors"] == 0
    assert row["files_in_namespace"] >= 400  # the rebuilt namespace has every file again
    for key in ("puts_per_s", "master_cpu_ms_per_put", "stat_per_s", "prefix_paths_per_s", "empty_grpc_per_s",
                "report_rpcs_per_s", "rebuild_s"):
        assert row[key] > 0, key
    mib = summary["mib"]
    for key in ("put_dataplane_gbps", "put_short_circuit_gbps", "put_dataplane_16mib_gbps", "tcp_gbps",
                "dataplane_vs_tcp", "dataplane_vs_16mib"):
        assert mib[key] > 0, key
    arms = [(p["arm"], p["shards"]) for p in summary["past_one_master"]]
    want = [("l2fs masters by path hash", 1), ("l2fs masters by path hash", 2)]
    if shutil.which("redis-server"):
        want.append(("redis namespace (MGET + SET NX)", 1))
    assert arms == want
    for p in summary["past_one_master"]:
        assert p["published"] == 400 and p["put_errors"] == 0 and p["lookup_errors"] == 0, p
        assert p["puts_per_s"] > 0 and p["prefix_paths_per_s"] > 0, p
    assert summary["past_one_master"][1]["files_per_master"][0] > 0
    assert summary["past_one_master"][1]["files_per_master"][1] > 0
    for header in ("master CPU ms/put", "empty gRPC /s", "rebuild s", "data plane / TCP", "Past one master"):
        assert header in r.stdout, header


def test_bench_l2_metadata_bad_input() -> None:
    r = _kvtier("bench", "l2", "--metadata", "--files", "abc", timeout=60)
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
