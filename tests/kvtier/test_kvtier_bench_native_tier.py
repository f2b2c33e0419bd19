"""`kvtier bench native-tier --quick` (kvtier/bench/native_tier.py) runs every arm against real vLLM tiers (its
TieringOffloadingSpec + our L2fsTier / its own `fs` tier) and a real l2fs cluster, prints a well-formed table
and JSON, and every arm loads back the bytes it stored. It is a benchmark: no speed is asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")
ROOT = Path(__file__).resolve().parents[2]


def test_native_tier_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "native.json"
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "native-tier", "--quick", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    arms = res["arms"]
    assert {"l2fs tier", "fs on local dir"} <= set(arms)
    assert set(arms) | set(res["skipped"]) == {"l2fs tier", "fs on l2fs mount", "fs on local dir"}
    for a in arms.values():
        assert a["bytes_ok"] and a["lookups_per_s"] > 0 and a["load_gbps"] > 0
        assert len(a["raw_lookup_s"]) == len(a["raw_load_s"]) == 3
    assert arms["fs on local dir"]["load_vs_local"] == 1.0
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert len(table) == 2 + 3 and all(ln.count("|") == table[0].count("|") for ln in table)


def test_native_tier_gpu_script_argv_is_what_vllm_parses() -> None:
    """The GPU script's engine argv, read by vLLM's own api_server parser (no GPU needed); without CUDA the
    script itself says so and exits 2 instead of starting engines."""
    from kvtier.bench import native_tier_gpu as g

    argv = g.engine_argv("/models/m", 8123, "10.0.0.1:7070", "node-2", 1 << 30, 0.5, 4160)
    ns = g.parse_with_vllm(argv)
    kt = ns.kv_transfer_config
    assert kt.kv_connector == "OffloadingConnector" and kt.kv_role == "kv_both"
    extra = kt.kv_connector_extra_config
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] == 1 << 30
    (tier,) = extra["secondary_tiers"]
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from connector.vllm_native_l2fs import L2fsTier

    assert SecondaryTierFactory.get_tier_class(tier) is L2fsTier  # vLLM's own loader resolves module_path
    assert (tier["master"], tier["node_id"]) == ("10.0.0.1:7070", "node-2")
