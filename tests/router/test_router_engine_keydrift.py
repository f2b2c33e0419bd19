"""Key drift seen from both sides: an engine whose installed LMCache hashes chunks differently stops writing
L2, and a router WITHOUT LMCache in its image (as deploy/Dockerfile builds it) notices through that engine's
key-compat record and gives no L2 credit. (Agreeing records, a drift that clears when the record is rewritten,
malformed and stale records: tests/router/test_router_keyrecords.py; the plugin's record itself:
tests/connector/test_connector_keydrift.py.)

Real processes on a real l2fs cluster: the engine is LMCache's own StorageManager with the l2fs plugin (no
vLLM), "the next LMCache" is the installed one with its token hasher patched by a sitecustomize on the engine's
PYTHONPATH (tests/import_patch.py); the router is `router.cli` with LMCache made unimportable the same way, so
its own start-up check can only answer "unverified" and the engine's record is the only evidence.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from import_patch import hidden, sitecustomize
from router_helpers import PY, ROOT, Cluster, l2_key_state, spawn_router, wait_until

from kvtier import contract
from l2fs import procs

if importlib.util.find_spec("lmcache") is None:
    pytest.skip("lmcache not installed", allow_module_level=True)

MODEL = "org/drift-e2e"
REPLICA = "engine-next"
ENGINE_PREFIX = f"{contract.KV_PREFIX}/engines"  # where the engine would write its chunks
NEXT_LMCACHE = sitecustomize("lmcache.v1.token_database", r"""
            module.TokenDatabase._get_vllm_hash_func = lambda self, algo: (lambda x: hash(("lmcache-next", x)))
""")
# One engine: LMCache's StorageManager with the l2fs plugin (as tests/connector/test_connector_keydrift.py builds
# it), waits for its key-compat record, stores 3 chunks, prints its key check and counters.
ENGINE = r'''
import json, os, sys, time
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager
from connector.config import lmcache_config
from kvtier import contract
from l2fs.client import Client

master, prefix, model, n = sys.argv[1], sys.argv[2], sys.argv[3], 3
d = lmcache_config(chunk_size=256, l1_gb=0.1, l2fs_master=master, node_id="node-1", prefix=prefix, l2_timeout=1.0)
d.pop("remote_serde")
md = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                     kv_dtype=torch.float32, kv_shape=(4, 2, 256, 2, 64))
sm = StorageManager(LMCacheEngineConfig.from_defaults(**d), md, EventManager())
conn = next(b for k, b in sm.storage_backends.items() if k.startswith("RemoteBackend")).connection._connector
client = Client(master, timeout=5.0)
record = f"{contract.META_PREFIX}/{contract.esc(model)}/{contract.esc(os.environ['KVTIER_REPLICA_ID'])}.json"
deadline = time.monotonic() + 60
while (client.stat(record) or time.sleep(0.1)) is None:
    assert time.monotonic() < deadline, "the plugin never wrote its key-compat record"
keys, objs = [], []
for i in range(n):
    keys.append(CacheEngineKey(model_name=model, world_size=1, worker_id=0, chunk_hash=7000 + i,
                               dtype=torch.float32))
    obj = sm.allocate(torch.Size([2, 4, 256, 128]), torch.float32, MemoryFormat.KV_2LTD)
    obj.tensor.fill_(float(i))
    objs.append(obj)
sm.batched_put(keys, objs)
done = ("put", "put_exists", "put_fail", "put_drift")
while sum(conn.stats[k] for k in done) < n:
    assert time.monotonic() < deadline, conn.stats
    time.sleep(0.1)
print("KVTIER-ENGINE " + json.dumps({"state": conn.key_check.state, "stats": conn.stats}), flush=True)
sm.close()
client.close()
'''


def _engine(tmp: Path, name: str, master: str, pythonpath: str) -> tuple[dict, str]:
    """Run one engine to completion; (its printed result, its log)."""
    script = tmp / "engine.py"
    script.write_text(ENGINE)
    log = tmp / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONHASHSEED="0", KVTIER_REPLICA_ID=REPLICA,
               LMCACHE_TRACK_USAGE="false")
    p = procs.spawn([PY, str(script), master, ENGINE_PREFIX, MODEL], log, env=env, cwd=ROOT, append=False)
    try:
        rc = p.wait(timeout=240)
    except subprocess.TimeoutExpired:
        procs.stop(p, grace=5)
        raise AssertionError(f"engine {name} did not finish: {log.read_text()[-3000:]}") from None
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("KVTIER-ENGINE ")]
    assert rc == 0 and lines, text[-3000:]
    return json.loads(lines[-1][len("KVTIER-ENGINE "):]), text


def test_drifted_engine_stops_writing_and_turns_the_router_to_drift(
        tmp_path: Path, cluster: Cluster, make_cluster: Callable[..., Any]) -> None:
    l2 = make_cluster(1)
    client = l2.client(timeout=5.0)
    prompt = "".join(chr(65 + (i * 11) % 26) for i in range(600))  # bytes tokenizer: 2 full chunks
    for h in contract.chunk_hashes(list(prompt.encode())):  # chunks today's engines wrote: 512 tokens of credit
        client.put(contract.plugin_path(contract.KV_PREFIX, MODEL, 1, 0, h, "float"), b"kv-bytes")
    dirs = {}
    for name, source in (("next", NEXT_LMCACHE), ("no-lmcache", hidden("lmcache"))):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / "sitecustomize.py").write_text(source)

    # the router as deployed: no LMCache importable, so its own check says "unverified" and it gives L2 credit
    rep = cluster.replica(kv=False)
    router = spawn_router(["--port", "0", "--replicas", rep.url, "--strategy", "kvaware", "--l2fs-master", l2.master,
                           "--l2fs-model-name", MODEL, "--l2fs-key-records-interval", "0.5", "--l2fs-timeout", "5",
                           "--l2fs-lookup", "always"],
                          tmp_path / "router.log", f"{dirs['no-lmcache']}{os.pathsep}{ROOT}")
    cluster.procs.append(router)
    assert wait_until(lambda: l2_key_state(router) == contract.KEY_UNVERIFIED, timeout=120), router.log.read_text()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    r = router.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers.get("x-kvtier-l2-tokens") == "512", r.headers

    # an engine whose installed LMCache hashes differently: KVTIER KEY DRIFT, no chunk written, its record says so
    got, text = _engine(tmp_path, "engine-next", l2.master, f"{dirs['next']}{os.pathsep}{ROOT}")
    assert got["state"] == contract.KEY_DRIFT and "KVTIER KEY DRIFT: lmcache_l2fs" in text
    assert got["stats"]["put_drift"] == 3 and got["stats"]["put"] == 0
    assert client.ls(ENGINE_PREFIX) == []  # it made its prefix at start-up (so it was connected), wrote nothing

    # ... and the router turns to drift because of that record: gauge, one ERROR line naming it, no L2 credit
    wait_until(lambda: l2_key_state(router) == contract.KEY_DRIFT, timeout=30)
    lines = [ln for ln in router.log.read_text().splitlines() if "KVTIER KEY DRIFT" in ln]
    assert len(lines) == 1 and "ERROR" in lines[0] and REPLICA in lines[0] and "no L2 credit" in lines[0], lines
    r = router.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text  # still routed, by load
    assert "x-kvtier-l2-tokens" not in r.headers
    client.close()
