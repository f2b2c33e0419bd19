"""kvtier.contract's pure-Python chunk hashes and file names == what real LMCache + vLLM produce.

The router computes L2 chunk paths without LMCache; this pins that reimplementation to the engine: the
reference side runs in a subprocess with the replicas' PYTHONHASHSEED, importing the real LMCache
ChunkedTokenDatabase (builtin hash, vLLM's NONE_HASH), connector.keys (plugin names) and LMCache's
FSConnector file naming (mount names). An LMCache or vLLM upgrade fails here loudly, before it silently
turns every router L2 lookup into a miss.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from rotation import of_the_day

from kvtier import contract

pytest.importorskip("lmcache")
ROOT = Path(__file__).resolve().parents[2]

REFERENCE = r"""
import json, sys, types, torch
import vllm
from importlib.metadata import version
from lmcache.v1.token_database import ChunkedTokenDatabase
from lmcache.v1.storage_backend.connector.fs_connector import FSConnector
from lmcache.utils import CacheEngineKey
from connector.keys import key_to_name
cases = json.loads(sys.stdin.read())
out = {"lmcache": version("lmcache"), "vllm": vllm.__version__, "hash": sys.hash_info.algorithm, "cases": []}
fs = object.__new__(FSConnector)  # _get_file_name reads only the key
for c in cases:
    meta = types.SimpleNamespace(model_name=c["model"], world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                 use_mla=False)
    cfg = types.SimpleNamespace(chunk_size=c["chunk_size"], save_unfull_chunk=False, remote_url=None,
                                enable_pd=False, pre_caching_hash_algorithm="builtin",
                                get_extra_config_value=lambda k, d: d)
    db = ChunkedTokenDatabase(cfg, meta)
    keys = [k for _s, _e, k in db.process_tokens(tokens=c["tokens"])]
    out["cases"].append({"hashes": [k.chunk_hash for k in keys],
                         "plugin": [key_to_name(k) for k in keys],
                         "mount": [fs._get_file_name(k) for k in keys]})
print(json.dumps(out))
"""


def reference(seed: str, cases: list[dict]) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", REFERENCE], input=json.dumps(cases), capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_cases() -> list[dict]:
    rng = random.Random(7)
    return [
        {"model": "org/Model-7B", "chunk_size": 256, "tokens": [rng.randrange(152_000) for _ in range(1100)]},
        {"model": "/models/tiny model@v1%", "chunk_size": 16, "tokens": [rng.randrange(50) for _ in range(100)]},
        {"model": "m", "chunk_size": 4, "tokens": [0, 1, 2, 3, 2**40, 7, 7, 7, 1, 2]},  # big ids: int hash path
        {"model": "m", "chunk_size": 256, "tokens": list(range(255))},  # no full chunk: nothing stored
    ]


@pytest.mark.parametrize("seed", of_the_day(["0", "42", "4294967295"], ids=["0", "42", "4294967295"]))
def test_chunk_hashes_and_names_match_real_lmcache(seed: str) -> None:
    cases = make_cases()
    ref = reference(seed, cases)
    # the reimplementation is tied to these versions: re-verify (this test) before changing them
    assert (ref["lmcache"], ref["vllm"], ref["hash"]) == (contract.LMCACHE_VERSION, contract.VLLM_VERSION,
                                                          contract.PYTHON_STR_HASH)
    assert [len(r["hashes"]) for r in ref["cases"]] == [4, 6, 2, 0]
    for case, want in zip(cases, ref["cases"], strict=True):
        got = contract.chunk_hashes(case["tokens"], case["chunk_size"], seed)
        assert got == want["hashes"]
        m = case["model"]
        assert [contract.plugin_name(m, 1, 0, h, "bfloat16") for h in got] == want["plugin"]
        assert [contract.mount_name(m, 1, 0, h, "bfloat16") for h in got] == want["mount"]


@pytest.mark.unit
def test_hashes_depend_on_seed_and_whole_prefix() -> None:
    toks = list(range(64))
    a = contract.chunk_hashes(toks, 16, "0")
    assert len(a) == 4 and len(set(a)) == 4
    assert contract.chunk_hashes(toks, 16, "1") != a
    b = contract.chunk_hashes([99, *toks[1:]], 16, "0")
    assert all(x != y for x, y in zip(a, b, strict=True))  # chained: a changed first chunk changes every hash
    assert contract.chunk_hashes(toks + [1, 2, 3], 16, "0") == a  # the partial tail is never a chunk
    with pytest.raises(ValueError):
        contract.none_hash("random")


@pytest.mark.unit
def test_chunk_path_modes() -> None:
    assert contract.chunk_path("plugin", "/kvtier/kv/", "a/b", 1, 0, -255, "half") == "/kvtier/kv/a%2Fb/a%2Fb@1@0@-ff@half.data"
    assert contract.chunk_path("mount", "/kvtier/kv", "a/b", 1, 0, -255, "half") == "/kvtier/kv/a-SEP-b@1@0@-ff@half.data"
    with pytest.raises(ValueError):
        contract.chunk_path("s3", "/kvtier/kv", "m", 1, 0, 1, "half")


@pytest.mark.unit
def test_contract_is_a_stdlib_only_bottom_layer() -> None:
    code = ("import sys; before = set(sys.modules); import kvtier.contract; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "bad = sorted(new - set(sys.stdlib_module_names) - {'kvtier'}); print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
