"""LMCache multiprocess mode on CPU, end to end without vLLM: real `lmcache server` processes with kvtier's L2
adapter (loaded by LMCache's `{"type":"plugin","module_path":...}`) and LMCache's OWN MP client, `lmcache bench
server --mode cpu` (REGISTER_KV_CACHE, LOOKUP, STORE/RETRIEVE of CPU KV tensors, checksums of the KV over the
server's HTTP API), against a real l2fs master + 2 workers, in both transfer modes: engine_driven (what vLLM's
CPU engines use) and lmcache_driven (the client's KV in POSIX shared memory, copied by the server).

Server A on node-1 stores two 2-chunk sequences (cold misses, then L1 hits). It is stopped; server B on node-2
starts with an empty L1, so its first lookups can only be answered from l2fs: 2/2 chunks hit, and the KV it
retrieves has the checksums A stored. With the l2fs objects removed, server C misses (the hits were l2fs's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("lmcache")
from import_patch import sitecustomize
from rotation import of_the_day

from connector import keys as ckeys
from kvtier.devstack.mp_server import MPServer, start_mp_server
from l2fs.testing.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/kvtier/mp-e2e"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), LMCACHE_TRACK_USAGE="false", PYTHONHASHSEED="0",
           LMCACHE_DISABLE_BANNER="1")


def _server(master: str, node: str, log: Path, env: dict[str, str] = ENV,
            mode: str = "engine_driven") -> tuple[MPServer, int, int]:
    srv = start_mp_server(master, node, log, prefix=PREFIX, l1_gb=0.2, env=env, transfer_mode=mode)
    return srv, srv.port, srv.http_port


def _client(port: int, http: int, out: Path, mode: str = "engine_driven") -> dict[str, list[str]]:
    """LMCache's MP client on CPU over two sequences; per 'seq N/kind': its LOOKUP/STORE/RETRIEVE/CHECKSUM lines.
    mode lmcache_driven: the client's KV tensors move into POSIX shared memory and the server copies them."""
    r = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "bench", "server", "--mode", "cpu",
                        "--transfer-mode", mode, "--rpc-url", f"tcp://127.0.0.1:{port}",
                        "--url", f"http://127.0.0.1:{http}", "--num-tokens", "512", "--start", "0", "--end", "2",
                        "--interval", "0.2", "--num-blocks", "128", "--block-size", "16",
                        "--kvcache-shape-spec", "(2,128,16,2,64):float16:2"],
                       capture_output=True, text=True, env=ENV, timeout=600)
    out.write_text(r.stdout + r.stderr)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    steps: dict[str, list[str]] = {}
    for m in re.finditer(r"^\s*\[seq (\d+)/(cold|warm)\] (\w+): (.*)$", r.stdout, re.M):
        steps.setdefault(f"{m.group(1)}/{m.group(2)}", []).append(f"{m.group(3)}: {m.group(4)}")
    return steps


def _first(lines: list[str], what: str) -> str:
    return next(x for x in lines if x.startswith(what + ":"))[len(what) + 2:]


def _checksum(lines: list[str]) -> str:
    return _first(lines, "CHECKSUM").split()[0]


@pytest.mark.parametrize("mode", of_the_day(["engine_driven", "lmcache_driven"], ids=["engine_driven", "lmcache_driven"]))
def test_lmcache_server_shares_kv_across_nodes_through_l2fs(tmp_path: Path, mode: str,
                                                            make_cluster: Callable[..., LocalCluster]) -> None:
    c = make_cluster(2)
    a, pa, ha = _server(c.master, "node-1", tmp_path / "server-a.log", mode=mode)
    try:
        run_a = _client(pa, ha, tmp_path / "client-a.log", mode)
    finally:
        a.stop()
    for seq in ("0", "1"):
        assert _first(run_a[f"{seq}/cold"], "LOOKUP").startswith("0/2 chunks hit")
        assert _first(run_a[f"{seq}/cold"], "STORE").startswith("stored (512 tokens")
    stored = {seq: _checksum(run_a[f"{seq}/cold"]) for seq in ("0", "1")}
    client = c.client()
    objs = [i for i in client.walk(PREFIX).values() if not i.is_dir]
    assert len(objs) == 4  # 2 sequences x 2 chunks, raw object bytes under reversible names
    keys = [ckeys.name_to_object_key(i.path.rsplit("/", 1)[1]) for i in objs]
    assert all(len(k.chunk_hash) == 32 for k in keys)  # LMCache MP's blake3 chunk hashes

    b, pb, hb = _server(c.master, "node-2", tmp_path / "server-b.log", mode=mode)  # empty L1, another node
    try:
        run_b = _client(pb, hb, tmp_path / "client-b.log", mode)
    finally:
        b.stop()
    for seq in ("0", "1"):
        assert _first(run_b[f"{seq}/cold"], "LOOKUP").startswith("2/2 chunks hit")
        assert _first(run_b[f"{seq}/cold"], "RETRIEVE").startswith("retrieved (512 tokens")
        assert _checksum(run_b[f"{seq}/warm"]) == stored[seq]  # the KV A stored, byte for byte

    for i in objs:
        client.rm(i.path)
    client.close()
    s3, p3, h3 = _server(c.master, "node-2", tmp_path / "server-c.log", mode=mode)
    try:
        run_c = _client(p3, h3, tmp_path / "client-c.log", mode)
    finally:
        s3.stop()
    assert all(_first(run_c[f"{seq}/cold"], "LOOKUP").startswith("0/2 chunks hit") for seq in ("0", "1"))


SITECUSTOMIZE = sitecustomize('lmcache.v1.multiprocess.token_hasher', r"""
            real = module._make_blake3_hash_func

            def next_blake3():  # "the next LMCache": tokens serialized in another order, other digests
                f = real()
                return lambda args: f((args[0], tuple(reversed(args[1])), args[2]))

            module._make_blake3_hash_func = next_blake3
""")


def test_lmcache_server_whose_hash_drifted_writes_nothing_to_l2fs(tmp_path: Path,
                                                                  make_cluster: Callable[..., LocalCluster]) -> None:
    """The MP adapter inside a real `lmcache server` whose installed LMCache hashes differently (patched at
    import by a sitecustomize): it says so once and stores nothing in l2fs; the server itself keeps serving
    from L1."""
    patched = tmp_path / "next-lmcache"
    patched.mkdir()
    (patched / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(ENV, PYTHONPATH=f"{patched}{os.pathsep}{ROOT}")
    c = make_cluster(1)
    s, port, http = _server(c.master, "node-1", tmp_path / "server.log", env)
    try:
        run = _client(port, http, tmp_path / "client.log")
    finally:
        s.stop()
    assert _first(run["0/cold"], "STORE").startswith("stored (512 tokens")  # L1 still works
    assert _first(run["0/warm"], "LOOKUP").startswith("2/2 chunks hit")
    client = c.client()
    try:
        assert not client.exists(PREFIX) or not [i for i in client.walk(PREFIX).values() if not i.is_dir]
    finally:
        client.close()
    drift = [ln for ln in (tmp_path / "server.log").read_text().splitlines() if "KVTIER KEY DRIFT: mp_l2fs" in ln]
    assert len(drift) == 1
