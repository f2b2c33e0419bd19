"""Tenant isolation: a per-endpoint secret KV salt (kvtier.contract.salted_prefix) against real LMCache + l2fs.

Two endpoints serve the same model and see the same prompt; with different salts their chunks land in
disjoint directories and neither replica (nor the router's L2 lookup without the right salt) finds the
other's. Writers (plugin mode through LMCache's StorageManager, mount mode through LMCache's own fs
connector) and the router compute the same directory. No salt = today's paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from polling import wait_until

pytest.importorskip("lmcache")

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from connector.config import lmcache_config, salt_secret
from kvtier import contract
from l2fs.testing.cluster import LocalCluster
from router.l2 import L2Lookup

ROOT = Path(__file__).resolve().parents[2]
MODEL = "/opt/ml/model"  # every HyperPod endpoint's model name: only the directory tells endpoints apart
SHAPE = torch.Size([2, 4, 256, 128])
SALT_A = "a" * 16 + "-tenant-a-secret"
SALT_B = "b" * 16 + "-tenant-b-secret"
TOKENS = [(i * 131) % 30000 for i in range(3 * 256 + 17)]  # three full chunks
CHUNKS = contract.chunk_hashes(TOKENS)


def _manager(node: str, *, master: str | None = None, mount: str | None = None, salt: str | None,
             namespace: str = "ep", revision: str = "rev1") -> StorageManager:
    d = lmcache_config(chunk_size=256, l1_gb=0.1, l2fs_master=master, mount_path=mount, node_id=node,
                       model_revision=revision, namespace=namespace, salt=salt)
    d.pop("remote_serde")
    meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float32, kv_shape=(4, 2, 256, 2, 64))
    return StorageManager(LMCacheEngineConfig.from_defaults(**d), meta, EventManager())


def _keys() -> list[CacheEngineKey]:
    return [CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=h, dtype=torch.float32)
            for h in CHUNKS]


def _put(sm: StorageManager, seed: int) -> list[torch.Tensor]:
    objs, datas = [], []
    for i in range(len(CHUNKS)):
        obj = sm.allocate(SHAPE, torch.float32, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed * 100 + i)))
        datas.append(obj.tensor.clone())
        objs.append(obj)
    sm.batched_put(_keys(), objs)
    return datas


def _wait(lookup: L2Lookup, prefix: str, want: int, timeout: float = 20.0) -> None:
    try:
        wait_until(lambda: lookup.lookup(TOKENS, MODEL, prefix) == want, timeout, 0.1)
    except AssertionError:
        raise AssertionError(f"L2 lookup of {prefix} never saw {want} tokens "
                             f"(last {lookup.lookup(TOKENS, MODEL, prefix)})") from None


@pytest.mark.unit
def test_salted_prefix_contract() -> None:
    base = "/kvtier/kv/ep/rev1"
    a, b = contract.salted_prefix(base, SALT_A), contract.salted_prefix(base, SALT_B)
    assert a != b and a.startswith(base + "/salt@") and b.startswith(base + "/salt@")
    assert a == contract.salted_prefix(base + "/", SALT_A.encode()) == f"{base}/{contract.salt_component(SALT_A)}"
    assert SALT_A not in a and len(a.rsplit("@", 1)[1]) == 32
    assert contract.salted_prefix(base, None) == contract.salted_prefix(base, "") == base  # no salt: today's
    with pytest.raises(ValueError, match="at least 16"):
        contract.salted_prefix(base, "short")
    # the salt directory can never be a plugin-mode model directory: '@' is always %-escaped there
    assert "@" not in contract.model_dir(base, "salt@" + "0" * 32).rsplit("/", 1)[1]
    # the chunk paths of the same prompt are disjoint between salts, and from the unsalted ones
    paths = {s: {contract.chunk_path(m, contract.salted_prefix(base, s), MODEL, 1, 0, h, "float")
                 for m in contract.L2_MODES for h in CHUNKS} for s in (SALT_A, SALT_B, None)}
    assert not paths[SALT_A] & paths[SALT_B] and not paths[SALT_A] & paths[None] and not paths[SALT_B] & paths[None]


@pytest.mark.unit
def test_env_salt_and_secret(tmp_path: Path) -> None:
    f = tmp_path / "salt"
    f.write_text(SALT_A + "\n")
    assert contract.env_salt({}) is None
    assert contract.env_salt({contract.SALT_ENV: SALT_B}) == SALT_B.encode()
    assert contract.env_salt({contract.SALT_ENV: SALT_B, contract.SALT_FILE_ENV: str(f)}) == SALT_A.encode()
    sec = salt_secret("ep-salt", "team-a", SALT_A)
    assert sec["kind"] == "Secret" and sec["metadata"] == {"name": "ep-salt", "namespace": "team-a",
                                                           "labels": {"app.kubernetes.io/part-of": "kvtier"}}
    assert sec["stringData"] == {"salt": SALT_A, "dir": contract.salt_component(SALT_A)}
    fresh = salt_secret("x")["stringData"]  # a new random salt each time
    assert len(fresh["salt"]) == 64 and fresh["dir"] == contract.salt_component(fresh["salt"])
    assert fresh["salt"] != salt_secret("x")["stringData"]["salt"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "lmcache-config", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_lmcache_config_cli_salt(tmp_path: Path) -> None:
    """`kvtier lmcache-config --kv-salt-file` / KVTIER_KV_SALT salt both modes' directories; none = today's."""
    f = tmp_path / "salt"
    f.write_text(SALT_A)
    common = ["--model", "m", "--model-revision", "r1", "--namespace", "ep", "--device", "cpu", "--format", "json"]
    plug = "remote_storage_plugin.l2fs.prefix"
    fs = "remote_storage_plugin.fs.base_path"

    def extra(*args: str, env: dict[str, str] | None = None) -> dict[str, str]:
        out = _cli(*common, *args, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["lmcache"]["extra_config"]

    clean = {contract.SALT_ENV: "", contract.SALT_FILE_ENV: ""}
    assert extra("--l2fs-master", "h:1", env=clean)[plug] == "/kvtier/kv/ep/r1"
    assert extra("--l2fs-master", "h:1", "--kv-salt-file", str(f))[plug] == contract.salted_prefix(
        "/kvtier/kv/ep/r1", SALT_A)
    assert extra("--l2fs-master", "h:1", env={contract.SALT_ENV: SALT_B})[plug] == contract.salted_prefix(
        "/kvtier/kv/ep/r1", SALT_B)
    assert extra("--mount", "/mnt/l2fs", env=clean)[fs] == "/mnt/l2fs/kvtier/kv/ep/r1"
    assert extra("--mount", "/mnt/l2fs", "--kv-salt-file", str(f))[fs] == "/mnt/l2fs" + contract.salted_prefix(
        "/kvtier/kv/ep/r1", SALT_A)
    short = tmp_path / "short"
    short.write_text("tiny")
    bad = _cli(*common, "--l2fs-master", "h:1", "--kv-salt-file", str(short))
    assert bad.returncode == 2 and "at least 16" in bad.stderr
    sec = _cli("salt-secret", "--name", "ep-salt", "--namespace", "ns", "--salt-file", str(f))
    assert sec.returncode == 0, sec.stderr
    assert yaml.safe_load(sec.stdout)["stringData"] == {"salt": SALT_A, "dir": contract.salt_component(SALT_A)}


def test_plugin_endpoints_with_different_salts_never_share(cluster: LocalCluster, tmp_path: Path) -> None:
    """Same model, same prompt, different salts: disjoint files, no hits across, the router finds each
    endpoint's chunks only with that endpoint's salt; an unsalted endpoint behaves as before."""
    rev = "/kvtier/kv/ep/rev1"
    a = _manager("node-1", master=cluster.master, salt=SALT_A)
    a2 = _manager("node-2", master=cluster.master, salt=SALT_A)  # a second replica of endpoint A
    b = _manager("node-2", master=cluster.master, salt=SALT_B)
    plain = _manager("node-1", master=cluster.master, salt=None, namespace="plain")
    salts = tmp_path / "router-salts"  # the router's per-endpoint salt files (a mounted Secret)
    salts.mkdir()
    (salts / "ep").write_text(SALT_A)
    router_a = L2Lookup(cluster.master, mode="plugin", model_name=MODEL, dtype="float", salt_dir=str(salts))
    router_b = L2Lookup(cluster.master, mode="plugin", model_name=MODEL, dtype="float", salts={rev: SALT_B})
    router_none = L2Lookup(cluster.master, mode="plugin", model_name=MODEL, dtype="float", salt_dir="")
    client = cluster.client()
    try:
        datas = _put(a, seed=1)
        _wait(router_a, rev, 3 * 256)
        assert router_b.lookup(TOKENS, MODEL, rev) == 0 and router_none.lookup(TOKENS, MODEL, rev) == 0
        assert b.batched_contains(_keys())[0] == 0 and b.get(_keys()[0]) is None  # B never loads A's KV
        assert a2.batched_contains(_keys())[0] == 3  # A's other replica does, bit for bit
        for k, d in zip(_keys(), datas, strict=True):
            obj = a2.get(k)
            assert obj is not None and torch.equal(obj.tensor, d)
            obj.ref_count_down()

        _put(b, seed=2)
        _wait(router_b, rev, 3 * 256)
        files = {s: {i.path for i in client.ls(contract.model_dir(contract.salted_prefix(rev, s), MODEL))}
                 for s in (SALT_A, SALT_B)}
        assert len(files[SALT_A]) == len(files[SALT_B]) == 3 and not files[SALT_A] & files[SALT_B]
        assert files[SALT_A] == set(router_a.paths(TOKENS, MODEL, rev))  # router and writers agree
        assert {i.path.rsplit("/", 1)[1] for i in client.ls(rev)} == {contract.salt_component(SALT_A),
                                                                      contract.salt_component(SALT_B)}

        # no salt: exactly today's layout, found by a router without salts
        _put(plain, seed=3)
        _wait(router_none, "/kvtier/kv/plain/rev1", 3 * 256)
        assert router_none.paths(TOKENS, MODEL, "/kvtier/kv/plain/rev1")[0] == contract.plugin_path(
            "/kvtier/kv/plain/rev1", MODEL, 1, 0, CHUNKS[0], "float")
        assert router_a.lookup(TOKENS, MODEL, "/kvtier/kv/plain/rev1") == 3 * 256  # no salt file for 'plain'
    finally:
        for sm in (a, a2, b, plain):
            sm.close()
        client.close()


def test_mount_mode_salted_names_match_the_router(tmp_path: Path) -> None:
    """Stock LMCache fs:// under the salted base_path writes the files the router's mount-mode lookup names."""
    mount = tmp_path / "mnt"
    names: dict[str, set[str]] = {}
    for salt in (SALT_A, SALT_B):
        sm = _manager("node-1", mount=str(mount), salt=salt)
        try:
            _put(sm, seed=1)
            want = set(L2Lookup("unused:1", mode="mount", model_name=MODEL, dtype="float",
                                salts={"/kvtier/kv/ep/rev1": salt}).paths(TOKENS, MODEL, "/kvtier/kv/ep/rev1"))

            def written(salt: str = salt, want: set[str] = want) -> bool:
                names[salt] = {"/" + str(p.relative_to(mount)) for p in mount.rglob("*.data")} - set().union(
                    *(v for k, v in names.items() if k != salt))
                return names[salt] == want

            wait_until(written, 20, 0.1)
        finally:
            sm.close()
    assert not names[SALT_A] & names[SALT_B]
