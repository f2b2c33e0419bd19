"""kvaware's L2 presence against a real l2fs cluster: the router finds the chunks the connector would write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from router_helpers import PY, ROOT, Proc, _spawn

LocalCluster = pytest.importorskip("l2fs.local").LocalCluster
pytest.importorskip("lmcache")

# The connector's side, in a process with the replicas' hash seed: LMCache's own CacheEngineKeys for the
# prompt (ChunkedTokenDatabase + metadata, as in the engine) named by connector.keys, as the connector does.
CONNECTOR_PATHS = r"""
import json, sys, types, torch
from lmcache.v1.token_database import ChunkedTokenDatabase
from connector.keys import key_path
meta = types.SimpleNamespace(model_name="tiny-model", world_size=1, worker_id=0, kv_dtype=torch.float32,
                             use_mla=False)
db = ChunkedTokenDatabase(None, meta)
tokens = json.loads(sys.argv[1])
print(json.dumps([key_path("/kvtier/kv", k) for _s, _e, k in db.process_tokens(tokens=tokens)]))
"""


def connector_paths(tokens: list[int]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CONNECTOR_PATHS, json.dumps(tokens)], capture_output=True,
                         text=True, cwd=ROOT, env=dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(ROOT)),
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_router_sees_l2_prefix_and_treats_l2_failure_as_miss(cluster, tmp_path: Path):
    from l2fs.client import Client

    prompt = "".join(chr(65 + (i * 7) % 26) for i in range(1100))  # bytes tokenizer: 1100 tokens, 4 chunks
    tokens = list(prompt.encode())
    paths = connector_paths(tokens)
    assert len(paths) == 5  # 4 full chunks + the partial tail, which the connector never stores
    paths = paths[:4]
    with LocalCluster(tmp_path / "l2", workers=1) as l2:
        c = Client(l2.master)
        for p in (paths[0], paths[1], paths[3]):  # chunk 2 missing: only the first two count
            c.put(p, b"kv-bytes")
        rep = cluster.replica(kv=False)
        cluster.n += 1
        log = tmp_path / "router-l2.log"
        p, url = _spawn([PY, "-m", "router.cli", "--port", "0", "--replicas", rep.url, "--strategy", "kvaware",
                         "--l2fs-master", l2.master, "--l2fs-model-name", "tiny-model"], log,
                        r"listening on (http://\S+)", timeout=120)
        rt = Proc(p, url, log)
        cluster.procs.append(rt)
        import httpx

        assert httpx.get(url + "/health", timeout=300).status_code == 200  # serves once LMCache is imported
        r = rt.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.headers.get("x-kvtier-l2-tokens") == str(2 * 256)
        # the router forgets nothing wrong when L2 goes away: lookups become misses, requests still work
        l2.kill_master()
        r = rt.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200 and "x-kvtier-l2-tokens" not in r.headers
        c.close()
