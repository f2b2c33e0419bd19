"""TTFT of the three tiers, measured side by side in one run (a benchmark, not a test).

For each prompt length: cold (replica A computes and stores), same-pod L1 hit (A again), cross-pod L2 hit
(replica B on another l2fs node, empty L0/L1, loads from l2fs), plus LMCache's own retrieve throughput on B
(L2 -> L1 -> vLLM KV, "L2 read GB/s inside the engine"). vLLM's own prefix cache is off, so every hit comes
from LMCache. Prints a table of raw numbers and the ratios against the goals (cross-pod within 1.25x of
the L1 hit; >= 2.7x faster than cold at ~2.5k tokens).

    flock /tmp/kvtier-vllm.lock .venv/bin/kvtier bench connector [--model DIR] \
        [--lengths 1000,2000,2500,4000,8000] [--reps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from connector import keys as ckeys
from kvtier.devstack.replica import Replica, start_replica
from l2fs.common import free_port
from l2fs.testing.cluster import LocalCluster


def wait_files(cluster: LocalCluster, model: str, n: int, timeout: float = 120) -> int:
    c = cluster.client()
    try:
        t0 = time.monotonic()
        got = 0
        while time.monotonic() - t0 < timeout:
            try:
                got = len([i for i in c.ls(ckeys.model_dir("/kvtier/kv", model)) if i.path.endswith(".data")])
            except Exception:  # noqa: BLE001
                got = 0
            if got >= n:
                break
            time.sleep(0.2)
        return got
    finally:
        c.close()


def run(model: str, lengths: list[int], reps: int, base: Path) -> list[dict]:
    rows: list[dict] = []
    with LocalCluster(base / "l2fs", workers=2) as cluster:
        a = b = None
        try:
            a = start_replica(model, free_port(), l2fs_master=cluster.master, node_id="node-1", l1_gb=2,
                              kv_cache_gb=2, log_path=base / "a.log", host_share=2)
            b = start_replica(model, free_port(), l2fs_master=cluster.master, node_id="node-2", l1_gb=2,
                              kv_cache_gb=2, log_path=base / "b.log", host_share=2)
            rng = random.Random(0)
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"] - 1
            for r in (a, b):  # warm-up: first requests pay one-off costs
                r.ttft([rng.randrange(10, vocab) for _ in range(300)])
            stored = wait_files(cluster, model, 2)  # each warm-up prompt stored one full chunk
            for n in lengths:
                for rep in range(reps):
                    p = [rng.randrange(10, vocab) for _ in range(n)]
                    cold = a.ttft(p)
                    stored += n // 256
                    have = wait_files(cluster, model, stored)
                    l1 = a.ttft(p)
                    nb = len(b.lmcache_retrievals())
                    cross = b.ttft(p)
                    retr = b.lmcache_retrievals()[nb:]
                    hit = b.lmcache_hits()[-1][2]
                    rows.append({"tokens": n, "rep": rep, "cold_ms": cold * 1e3, "l1_ms": l1 * 1e3,
                                 "cross_ms": cross * 1e3, "b_hit_tokens": hit, "l2_files": have,
                                 "b_retrieve_ms": retr[-1]["ms"] if retr else None,
                                 "b_retrieve_gbps": retr[-1]["gbps"] if retr else None})
                    print(f"{n:>5} tok rep {rep}: cold {cold * 1e3:.0f} ms, L1 {l1 * 1e3:.0f} ms, "
                          f"cross-pod {cross * 1e3:.0f} ms (B hit {hit})", file=sys.stderr, flush=True)
        finally:
            for r in (a, b):
                if isinstance(r, Replica):
                    r.stop()
    return rows


def table(rows: list[dict], lengths: list[int]) -> str:
    hdr = ("tokens", "cold ms", "L1-hit ms", "cross-pod ms", "cross/L1", "cold/cross", "B hit tok",
           "B retrieve ms", "B retrieve GB/s")
    out = [" | ".join(f"{h:>14}" for h in hdr)]
    for n in lengths:
        rs = [r for r in rows if r["tokens"] == n]
        if not rs:
            continue
        med = {k: statistics.median([r[k] for r in rs if r[k] is not None] or [float("nan")])
               for k in ("cold_ms", "l1_ms", "cross_ms", "b_retrieve_ms", "b_retrieve_gbps")}
        vals = (n, f"{med['cold_ms']:.0f}", f"{med['l1_ms']:.0f}", f"{med['cross_ms']:.0f}",
                f"{med['cross_ms'] / med['l1_ms']:.2f}x", f"{med['cold_ms'] / med['cross_ms']:.1f}x",
                min(r["b_hit_tokens"] for r in rs), f"{med['b_retrieve_ms']:.1f}", f"{med['b_retrieve_gbps']:.3f}")
        out.append(" | ".join(f"{v!s:>14}" for v in vals))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench connector", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path(".kvtier") / "test-cache" / "tiny-llama"))
    p.add_argument("--lengths", default="1000,2000,2500,4000,8000")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    if not (Path(a.model) / "config.json").exists():
        from kvtier.devstack.tiny_model import build

        build(Path(a.model))
    with tempfile.TemporaryDirectory(prefix="kvtier-connector-bench-") as d:
        rows = run(a.model, lengths, a.reps, Path(d))
    print(f"\nmodel {a.model}; medians of {a.reps} reps; TTFT = first streamed token; vLLM prefix cache off")
    print(table(rows, lengths))
    print("goals: cross/L1 <= 1.25x; cold/cross >= 2.7x at ~2.5k tokens")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
