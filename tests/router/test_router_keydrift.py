"""The router (a real process) checks the installed LMCache's chunk keys at start-up and, when they drift from
kvtier.contract, gives no L2 credit (one ERROR line, gauge kvtier_router_l2_key_check{state="drift"}).

"The next LMCache" is the installed one with its hash function monkeypatched by a sitecustomize on the
router's PYTHONPATH: it patches LMCache's TokenDatabase._get_vllm_hash_func when that module is imported,
i.e. in the child the router starts to hash the known-answer tokens with the installed LMCache. A second
router without the patch, over the same l2fs chunks, credits them (control).
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from import_patch import sitecustomize
from router_helpers import PY, ROOT, Proc

from kvtier import contract
from l2fs import procs

if importlib.util.find_spec("lmcache") is None:
    pytest.skip("lmcache not installed", allow_module_level=True)

SITECUSTOMIZE = sitecustomize('lmcache.v1.token_database', r"""
            module.TokenDatabase._get_vllm_hash_func = lambda self, algo: (lambda x: hash(("lmcache-next", x)))
""")


def _router(args: list[str], log: Path, pythonpath: str) -> Proc:
    p = procs.spawn([PY, "-m", "router.cli", *args], log, env=dict(os.environ, PYTHONPATH=pythonpath), cwd=ROOT,
                    append=False)
    try:
        url = procs.wait_ready(p, procs.log_match(log, r"listening on (http://\S+)"), timeout=120,
                               what="router", log_path=log)
    except BaseException:
        procs.stop(p, grace=5)
        raise
    return Proc(p, url, log)


def _state(rt: Proc) -> str | None:
    text = httpx.get(rt.url + "/metrics", timeout=10).text
    on = re.findall(r'^kvtier_router_l2_key_check\{state="(\w+)"\} 1\.0$', text, re.M)
    return on[0] if on else None


def test_router_drops_l2_credit_when_installed_lmcache_keys_drift(cluster, tmp_path: Path,
                                                                  make_cluster: Callable[..., Any]) -> None:
    from l2fs.client import Client

    prompt = "".join(chr(65 + (i * 7) % 26) for i in range(600))  # bytes tokenizer: 2 full chunks
    tokens = list(prompt.encode())
    patched = tmp_path / "next-lmcache"
    patched.mkdir()
    (patched / "sitecustomize.py").write_text(SITECUSTOMIZE)
    l2 = make_cluster(1)
    c = Client(l2.master)
    for h in contract.chunk_hashes(tokens):  # the chunks replicas of today's LMCache wrote
        c.put(contract.plugin_path(contract.KV_PREFIX, "tiny-model", 1, 0, h, "float"), b"kv-bytes")
    rep = cluster.replica(kv=False)
    args = ["--port", "0", "--replicas", rep.url, "--strategy", "kvaware", "--l2fs-master", l2.master,
            "--l2fs-model-name", "tiny-model", "--l2fs-timeout", "5", "--l2fs-lookup", "always"]  # 5 s: a loaded box's lookups are no misses
    bad = _router(args, tmp_path / "router-drift.log", f"{patched}{os.pathsep}{ROOT}")
    good = _router(args, tmp_path / "router-ok.log", str(ROOT))
    cluster.procs += [bad, good]
    t0 = time.monotonic()
    while _state(bad) == contract.KEY_PENDING or _state(good) == contract.KEY_PENDING:
        assert time.monotonic() - t0 < 300, "the key check never answered"
        time.sleep(1)
    assert _state(good) == contract.KEY_OK, good.log.read_text()[-2000:]
    assert _state(bad) == contract.KEY_DRIFT, bad.log.read_text()[-2000:]
    drift_lines = [ln for ln in bad.log.read_text().splitlines() if "KVTIER KEY DRIFT" in ln]
    assert len(drift_lines) == 1 and "no L2 credit" in drift_lines[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    r = good.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers.get("x-kvtier-l2-tokens") == str(2 * 256)
    r = bad.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text  # still routes (load balancing), with no L2 credit
    assert "x-kvtier-l2-tokens" not in r.headers
    c.close()
