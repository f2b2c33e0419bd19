"""kvaware's L2 presence against a real l2fs cluster: the router finds the chunks the connector would write."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from router_helpers import PY, ROOT, Proc, _spawn, metric, wait_until

if importlib.util.find_spec("lmcache") is None:  # the reference side needs it; this process never imports it
    pytest.skip("lmcache not installed", allow_module_level=True)

# The replicas' side, in a process with their hash seed: LMCache's own CacheEngineKeys for the prompt
# (ChunkedTokenDatabase + metadata, as in the engine), named as each L2 mode names them: plugin mode by
# connector.keys (the connector), mount mode by LMCache's FSConnector under base_path <mount>/kvtier/kv
# (its l2fs path is that relative to the mount root).
CONNECTOR_PATHS = r"""
import json, sys, types, torch
from pathlib import PurePosixPath
from lmcache.v1.token_database import ChunkedTokenDatabase
from lmcache.v1.storage_backend.connector.fs_connector import FSConnector
from connector.keys import key_path
meta = types.SimpleNamespace(model_name=sys.argv[2], world_size=1, worker_id=0, kv_dtype=torch.float32,
                             use_mla=False)
db = ChunkedTokenDatabase(None, meta)
tokens = json.loads(sys.argv[1])
fs = object.__new__(FSConnector)  # _get_file_name reads only the key
keys = [k for _s, _e, k in db.process_tokens(tokens=tokens)]
print(json.dumps({"plugin": [key_path("/kvtier/kv", k) for k in keys],
                  "mount": [str(PurePosixPath("/kvtier/kv") / fs._get_file_name(k)) for k in keys]}))
"""


def connector_paths(tokens: list[int], mode: str = "plugin", model: str = "tiny-model") -> list[str]:
    out = subprocess.run([sys.executable, "-c", CONNECTOR_PATHS, json.dumps(tokens), model], capture_output=True,
                         text=True, cwd=ROOT, env=dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(ROOT)),
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])[mode]


@pytest.mark.parametrize("mode", ["plugin", "mount"])
def test_l2_lookup_finds_chunks_as_each_mode_writes_them(mode: str, make_cluster: Callable[..., Any]) -> None:
    """In-process L2Lookup (no LMCache in this process) against a real l2fs holding a chunk gap."""
    from l2fs.client import Client
    from router.l2 import L2Lookup

    tokens = [(i * 37) % 32000 for i in range(5 * 256 + 10)]
    paths = connector_paths(tokens, mode, "org/Model-7B")[:5]
    l2 = make_cluster(1)
    with Client(l2.master) as c:
        for p in paths[:3] + paths[4:]:  # chunk 3 missing: only the first three count
            c.put(p, b"kv-bytes")
        lk = L2Lookup(l2.master, mode=mode, model_name="org/Model-7B")
        assert lk.paths(tokens, "ignored") == paths
        assert lk.lookup(tokens, "ignored") == 3 * 256
        assert lk.errors == 0
        other = "plugin" if mode == "mount" else "mount"
        assert L2Lookup(l2.master, mode=other, model_name="org/Model-7B").lookup(tokens, "x") == 0


def test_router_sees_l2_prefix_and_treats_l2_failure_as_miss(cluster, tmp_path: Path, make_cluster):
    from l2fs.client import Client

    prompt = "".join(chr(65 + (i * 7) % 26) for i in range(1100))  # bytes tokenizer: 1100 tokens, 4 chunks
    tokens = list(prompt.encode())
    paths = connector_paths(tokens)
    assert len(paths) == 5  # 4 full chunks + the partial tail, which the connector never stores
    paths = paths[:4]
    l2 = make_cluster(1)
    c = Client(l2.master)
    for p in (paths[0], paths[1], paths[3]):  # chunk 2 missing: only the first two count
        c.put(p, b"kv-bytes")
    rep = cluster.replica(kv=False)
    cluster.n += 1
    log = tmp_path / "router-l2.log"
    p, url = _spawn([PY, "-m", "router.cli", "--port", "0", "--replicas", rep.url, "--strategy", "kvaware",
                     "--l2fs-master", l2.master, "--l2fs-model-name", "tiny-model", "--l2fs-timeout", "5",
                     "--l2fs-min-tokens", "1024", "--l2fs-lookup", "always"], log, r"listening on (http://\S+)", timeout=120)
    rt = Proc(p, url, log)
    cluster.procs.append(rt)
    import httpx

    assert httpx.get(url + "/health", timeout=300).status_code == 200  # serves once LMCache is imported
    r = rt.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.headers.get("x-kvtier-l2-tokens") == str(2 * 256)
    # the same two chunks under a prompt shorter than --l2fs-min-tokens: not looked up, routed by L0/L1 and load
    r = rt.post("/v1/completions", json={"model": "tiny", "prompt": prompt[:1000], "max_tokens": 1})
    assert r.status_code == 200 and "x-kvtier-l2-tokens" not in r.headers
    # the router forgets nothing wrong when L2 goes away: lookups become misses, requests still work
    l2.kill_master()
    r = rt.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200 and "x-kvtier-l2-tokens" not in r.headers
    c.close()


def _master_lookup_hits(l2) -> float:
    """Paths the l2fs master itself counted as found by lookups (its /metrics): the RPCs it really answered."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{l2.master_metrics_port}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("l2fs_master_lookup_hits_total "))


def test_kvaware_waits_for_l2_only_when_an_answer_can_change_the_pick(cluster, tmp_path: Path, make_cluster):
    """--l2fs-lookup needed (the default): a prompt nobody holds, or one whose holder is cheaper than any L2
    hit could make another replica, is routed at once (no master RPC); when the holder is loaded so that
    L2 could tip the choice, the router asks and L2 moves the request to the idle replica."""
    from l2fs.client import Client

    prompt = "".join(chr(65 + (i * 7) % 26) for i in range(1100))  # bytes tokenizer: 1100 tokens, 4 chunks
    l2 = make_cluster(1)
    with Client(l2.master) as c:
        for path in connector_paths(list(prompt.encode()))[:4]:
            c.put(path, b"kv-bytes")
    reps = [cluster.replica("--decode-ms-per-token", "100") for _ in range(2)]
    # --request-cost 800: one request in flight on the holder (1,088 tokens held) leaves it cheaper by 288
    # tokens, less than the 544 an L2 hit at credit 0.5 can give the other replica, so L2 can tip it
    rt = cluster.router(reps, "--strategy", "kvaware", "--l2fs-master", l2.master, "--l2fs-model-name", "tiny-model",
                        "--l2fs-timeout", "5", "--request-cost", "800", kv=True)
    assert httpx_get_ok(rt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    base = _master_lookup_hits(l2)

    r = rt.post("/v1/completions", json=body)  # held nowhere: the home replica, whatever L2 says
    assert r.status_code == 200 and "x-kvtier-l2-tokens" not in r.headers, r.headers
    holder = r.headers["x-kvtier-replica"]
    other = next(x.url for x in reps if x.url != holder)
    assert wait_until(lambda: metric(rt, "kvtier_router_kv_index_blocks") > 0, timeout=30)
    r = rt.post("/v1/completions", json=body)  # the idle holder beats any L2 hit elsewhere: no lookup
    assert r.status_code == 200 and r.headers["x-kvtier-replica"] == holder
    assert metric(rt, "kvtier_router_l2_lookups_total", result="skipped") == 2
    assert _master_lookup_hits(l2) == base  # the master was never asked

    with rt_stream(rt, {**body, "max_tokens": 60, "stream": True}) as busy:  # 6 s in flight on the holder
        assert busy.headers["x-kvtier-replica"] == holder
        r = rt.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers.get("x-kvtier-l2-tokens") == str(4 * 256) and r.headers["x-kvtier-replica"] == other
    assert metric(rt, "kvtier_router_l2_lookups_total", result="hit") == 1
    assert metric(rt, "kvtier_router_l2_lookups_total", result="skipped") == 3  # the stream: holder idle
    assert _master_lookup_hits(l2) == base + 4


def httpx_get_ok(rt: Proc) -> bool:
    import httpx

    return httpx.get(rt.url + "/health", timeout=300).status_code == 200  # serves once LMCache is imported


@contextlib.contextmanager
def rt_stream(rt: Proc, body: dict) -> Iterator[Any]:
    """A streamed completion through the router, held open (first chunk read) while the block runs."""
    import httpx

    with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_bytes()
        next(chunks)
        yield resp
        for _ in chunks:
            pass


@pytest.mark.unit
def test_router_imports_no_connector_lmcache_or_vllm() -> None:
    code = ("import sys, router.cli, router.app, router.l2, router.policy; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('connector', 'lmcache', 'vllm', 'torch')); "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.unit
def test_cli_l2fs_flags_are_checked_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import build_parser, main

    args = build_parser().parse_args(["--l2fs-mode", "mount"])
    assert (args.l2fs_mode, args.l2fs_prefix, args.l2fs_hash_seed) == ("mount", "/kvtier/kv", "0")
    assert main(["--replicas", "http://127.0.0.1:9", "--l2fs-master", "127.0.0.1:1", "--l2fs-hash-seed", "x"]) == 2
    assert "PYTHONHASHSEED" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--l2fs-mode", "s3"])


def test_router_l2_flags_are_the_shared_l2fs_client_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          make_cluster: Callable[..., Any]) -> None:
    """The router's own parser takes l2fs's client group as --l2fs-* (token file, TLS CA, node id, $L2FS_* defaults)
    and its L2 lookup uses them: against a token cluster it finds a stored chunk with --l2fs-token-file and
    misses (an error, not a failure) without it."""
    from l2fs.client import Client
    from router.cli import build_parser, l2_lookup_from_args

    for var in ("L2FS_TOKEN", "L2FS_TOKEN_FILE", "L2FS_MASTER", "L2FS_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "tok").write_text("router-test-token\n")
    tokens = [(i * 11) % 32000 for i in range(2 * 256)]
    l2 = make_cluster(1, token="router-test-token")
    flags = ["--l2fs-master", l2.master, "--l2fs-model-name", "m"]
    ns = build_parser().parse_args([*flags, "--l2fs-token-file", str(tmp_path / "tok"), "--l2fs-node-id", "n-3"])
    lk = l2_lookup_from_args(ns)
    assert lk is not None and lk.client_options.node_id == "n-3"
    with Client(l2.master, token="router-test-token") as c:
        for p in lk.paths(tokens, "m"):
            c.put(p, b"kv-bytes")
    assert lk.lookup(tokens, "m") == 2 * 256
    bare = l2_lookup_from_args(build_parser().parse_args(flags))
    assert bare is not None and bare.lookup(tokens, "m") == 0 and bare.errors == 1
    monkeypatch.setenv("L2FS_TOKEN", "router-test-token")  # the environment default, as every l2fs command
    assert l2_lookup_from_args(build_parser().parse_args(flags)).lookup(tokens, "m") == 2 * 256
    monkeypatch.setenv("L2FS_MASTER", "h:1")
    assert build_parser().parse_args([]).l2fs_master == "h:1"
