"""`kvtier lmcache-config` and `kvtier model tiny` as commands (no engines)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from connector.config import lmcache_config, main, replica_env
from kvtier import contract
from l2fs.testing.cluster import LocalCluster


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120)


def test_config_for_l2fs_writes_yaml_env_and_args(tmp_path: Path) -> None:
    """The YAML as LMCache's own from_file() reads it, the env lines as a shell sources them (from another
    directory: LMCACHE_CONFIG_FILE is absolute); the vLLM args go through vLLM's parser in
    tests/operator/test_operator_consumers.py."""
    from lmcache.v1.config import LMCacheEngineConfig

    out = tmp_path / "lmc.yaml"
    r = _run("lmcache-config", "--model", "m", "--l2fs-master", "127.0.0.1:7000", "--node-id", "node-2",
             "--l1-gb", "3", "--chunk-size", "128", "--out", str(out), "--format", "env")
    assert r.returncode == 0, r.stderr
    env_file = tmp_path / "env.sh"
    env_file.write_text(r.stdout)
    (tmp_path / "elsewhere").mkdir()
    sourced = subprocess.run(["sh", "-c", f". {env_file} && env"], capture_output=True, text=True, timeout=30,
                             cwd=tmp_path / "elsewhere", env={"PATH": "/usr/bin:/bin"})
    env = dict(line.split("=", 1) for line in sourced.stdout.splitlines() if "=" in line)
    assert env["PYTHONHASHSEED"] == "0"
    cfg = LMCacheEngineConfig.from_file(env["LMCACHE_CONFIG_FILE"])
    assert cfg.chunk_size == 128 and cfg.max_local_cpu_size == 3.0
    assert cfg.remote_storage_plugins == ["l2fs"]
    ex = cfg.extra_config
    assert ex["remote_storage_plugin.l2fs.module_path"] == "connector.lmcache_l2fs"
    assert ex["remote_storage_plugin.l2fs.master"] == "127.0.0.1:7000"
    assert ex["remote_storage_plugin.l2fs.node_id"] == "node-2"


def test_config_mount_uses_lmcache_fs_connector() -> None:
    cfg = lmcache_config(mount_path="/mnt/l2fs")
    assert cfg["remote_storage_plugins"] == ["fs"]
    assert cfg["extra_config"]["remote_storage_plugin.fs.base_path"] == "/mnt/l2fs/kvtier/kv"
    assert "remote_storage_plugins" not in lmcache_config()  # L1 only


@pytest.mark.unit
def test_config_follows_the_key_contract() -> None:
    """Replicas, router and operator agree because all three read kvtier.contract."""
    from operator_patch.patch import PatchConfig

    cfg = lmcache_config(l2fs_master="h:1")
    ex = cfg["extra_config"]
    assert cfg["chunk_size"] == contract.CHUNK_SIZE
    assert cfg["pre_caching_hash_algorithm"] == contract.HASH_ALGORITHM
    assert cfg["remote_storage_plugins"] == [contract.PLUGIN_NAME]
    assert ex[f"remote_storage_plugin.{contract.PLUGIN_NAME}.module_path"] == contract.PLUGIN_MODULE
    assert importlib.util.find_spec(contract.PLUGIN_MODULE) is not None
    assert ex[f"remote_storage_plugin.{contract.PLUGIN_NAME}.prefix"] == contract.KV_PREFIX
    assert replica_env(None)["PYTHONHASHSEED"] == contract.HASH_SEED
    # mount mode: LMCache's fs base_path is <mount><prefix>, so its files are <prefix>/<name> in l2fs,
    # which is where the router's mount-mode lookup (contract.mount_path) looks
    base = lmcache_config(mount_path="/mnt/l2fs")["extra_config"]["remote_storage_plugin.fs.base_path"]
    assert base == "/mnt/l2fs" + contract.KV_PREFIX
    pc = PatchConfig()
    assert (pc.prefix, pc.hash_seed, pc.plugin_module, pc.plugin_class, pc.plugin_name) == (
        contract.KV_PREFIX, contract.HASH_SEED, contract.PLUGIN_MODULE, contract.PLUGIN_CLASS, contract.PLUGIN_NAME)


def test_config_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--chunk-size", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    r = _run("lmcache-config", "--l2fs-master", "a:1", "--mount", "/x")
    assert r.returncode == 2 and "not allowed with" in r.stderr


def test_check_reports_key_mismatch(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(1)
    c = cluster.client()
    base = {"model_name": "m/x", "kv_dtype": "float32", "chunk_size": 256, "hash_algorithm": "builtin",
            "python_hash_seed": "0", "world_size": 1}
    c.mkdir("/kvtier/meta/m%2Fx", parents=True)
    c.put("/kvtier/meta/m%2Fx/a.json", json.dumps({**base, "replica": "a"}).encode())
    c.put("/kvtier/meta/m%2Fx/b.json", json.dumps({**base, "replica": "b"}).encode())
    ok = _run("lmcache-config", "check", "--l2fs-master", cluster.master, "--model", "m/x")
    assert ok.returncode == 0, ok.stderr
    c.put("/kvtier/meta/m%2Fx/c.json", json.dumps({**base, "replica": "c", "chunk_size": 512}).encode())
    bad = _run("lmcache-config", "check", "--l2fs-master", cluster.master, "--model", "m/x")
    assert bad.returncode == 1 and "MISMATCH" in bad.stderr and "chunk_size" in bad.stderr
    c.close()


def test_tiny_model_is_deterministic_and_loads(tmp_path: Path, tiny_model: Path) -> None:
    r = _run("model", "tiny", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    h = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (tmp_path / "m", tiny_model)]
    assert h[0] == h[1]  # same seed, same weights
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    text = tok.apply_chat_template([{"role": "user", "content": "cache the prefix"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")
    ids = tok("the cache token model")["input_ids"]
    assert tok.decode(ids) == "the cache token model"
    bad = _run("model", "tiny", "--out", str(tmp_path / "x"), "--heads", "3")
    assert bad.returncode == 2 and "divide" in bad.stderr


def test_lmcache_config_takes_the_shared_l2fs_client_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str],
                                                           make_cluster: Callable[..., LocalCluster]) -> None:
    """`check` is a client of the cluster: l2fs's client group as --l2fs-* (here a token file against a token
    cluster); generating a replica's config takes --l2fs-master and --node-id/--l2fs-node-id from the same group
    but no default from this process's environment (the replica does not share it)."""
    monkeypatch.setenv("L2FS_MASTER", "elsewhere:1")
    monkeypatch.setenv("L2FS_NODE_ID", "this-host")
    assert main(["--mount", "/mnt/l2fs", "--format", "env"]) == 0  # no master, no node id from the environment
    out = capsys.readouterr().out
    assert "L2FS_MASTER" not in out and "this-host" not in out
    for flag in ("--node-id", "--l2fs-node-id"):
        assert main(["--l2fs-master", "m:1", flag, "node-9", "--format", "env"]) == 0
        out = capsys.readouterr().out
        assert "L2FS_NODE_ID=node-9" in out and "L2FS_MASTER=m:1" in out
    (tmp_path / "tok").write_text("cfg-test-token\n")
    cluster = make_cluster(1, token="cfg-test-token")
    c = cluster.client()
    c.mkdir("/kvtier/meta/m", parents=True)
    c.put("/kvtier/meta/m/a.json", json.dumps({"replica": "a", "model_name": "m"}).encode())
    c.close()
    args = ("lmcache-config", "check", "--l2fs-master", cluster.master, "--model", "m")
    ok = _run(*args, "--l2fs-token-file", str(tmp_path / "tok"))
    assert ok.returncode == 0 and '"replica": "a"' in ok.stdout, ok.stderr
    denied = _run(*args)
    assert denied.returncode == 2 and "kvtier lmcache-config check" in denied.stderr
