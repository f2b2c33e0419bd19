"""Order hints from a real engine: a vLLM CPU replica with LMCache + the l2fs plugin stores a prompt's chunks
with their index in the prompt, also when a later request extends an already cached prefix (LMCache then
stores only the new chunks, in a batch that starts in the middle of the chain).

Run: flock /tmp/kvtier-vllm.lock .venv/bin/pytest tests/connector/test_connector_order_vllm.py -m vllm
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from connector import keys as ckeys
from kvtier import contract
from kvtier.devstack.replica import start_replica
from l2fs.common import free_port
from l2fs.local import LocalCluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
CHUNK = 256


def _hints_by_hash(cluster: LocalCluster) -> dict[int, int]:
    """chunk hash -> order hint, from the worker manifests (read-only) of every stored KV chunk."""
    out: dict[int, int] = {}
    for w in cluster.workers:
        con = sqlite3.connect(f"file:{w.data_dir / 'manifest.sqlite3'}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT path, order_hint FROM blocks").fetchall()
        finally:
            con.close()
        for path, hint in rows:
            try:
                out[ckeys.name_to_key(path.rsplit("/", 1)[-1]).chunk_hash] = hint
            except ValueError:
                continue  # fingerprints and other files
    return out


def test_engine_stores_prompt_positions_across_an_extension(tmp_path: Path, tiny_model: Path) -> None:
    import random

    rng = random.Random(14)
    ids = [rng.randrange(10, 7000) for _ in range(8 * CHUNK + 40)]
    hashes = contract.chunk_hashes(ids[: 8 * CHUNK])
    with LocalCluster(tmp_path / "l2fs", workers=1) as cluster:
        rep = start_replica(tiny_model, free_port(), l2fs_master=cluster.master, node_id="node-1", l1_gb=0.5,
                            kv_cache_gb=1, log_path=tmp_path / "replica.log")
        try:
            rep.completion(ids[: 4 * CHUNK + 40], max_tokens=1)  # stores chunks 0-3
            deadline = time.monotonic() + 180
            while not set(hashes[:4]) <= set(_hints_by_hash(cluster)):
                assert time.monotonic() < deadline, "first 4 chunks never reached l2fs"
                time.sleep(0.3)
            rep.completion(ids, max_tokens=1)  # hits 0-3, stores only 4-7
            while not set(hashes) <= set(got := _hints_by_hash(cluster)):
                assert time.monotonic() < deadline, f"chunks 4-7 never reached l2fs: {len(got)} stored"
                time.sleep(0.3)
        finally:
            rep.stop()
    assert [got[h] for h in hashes] == list(range(8))
