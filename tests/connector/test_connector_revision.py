"""One KV namespace per model revision and the GPU-mode replica description.

Unit tests: the revision hash, the cuda arguments/env and the GPU plan (no GPU needed). The real-process
test drives LMCache's own StorageManager + our plugin against a real l2fs LocalCluster, configured from
tiny models on disk, all under one LMCache model name (/opt/ml/model, as on HyperPod).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from connector.config import (
    GpuSlot,
    detect_device,
    gpu_count,
    gpu_plan,
    lmcache_config,
    replica_env,
    resolve_revision,
    vllm_args,
)
from connector.revision import model_revision
from kvtier import contract

CPU_ONLY = ("--enforce-eager", "--no-enable-prefix-caching")


def _fake_model(d: Path, weights: bytes = b"\x01" * 4096) -> Path:
    """A model dir with a real safetensors layout: 8-byte header length, JSON header, tensor bytes."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(weights) // 4], "data_offsets": [0, len(weights)]}})
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode() + weights)
    (d / "README.md").write_text("not part of the identity")
    return d


def _flip(path: Path, offset_from_end: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.unit
def test_revision_follows_weight_bytes_not_mtime(tmp_path: Path) -> None:
    m = _fake_model(tmp_path / "m")
    rev = model_revision(m)
    assert len(rev) == 12 and rev == model_revision(m)
    st = (m / "model.safetensors").stat()
    import os

    os.utime(m / "model.safetensors", (st.st_atime + 1000, st.st_mtime + 1000))
    (m / "README.md").write_text("edited docs")
    assert model_revision(m) == rev  # mtime and non-weight files are not the identity
    shutil.copytree(m, tmp_path / "copy")
    assert model_revision(tmp_path / "copy") == rev  # where it lives is not the identity either
    _flip(m / "model.safetensors", 100)
    changed = model_revision(m)
    assert changed != rev  # one weight byte
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "hidden_size": 65}))
    assert model_revision(m) not in (rev, changed)
    with pytest.raises(ValueError, match="cannot derive"):
        model_revision(tmp_path / "empty-dir-that-does-not-exist")


@pytest.mark.unit
def test_large_weight_file_is_sampled_and_header_counted(tmp_path: Path) -> None:
    """Above the full-hash limit the tensor bytes are sampled; the safetensors header always counts."""
    m = _fake_model(tmp_path / "big", weights=bytes(8 << 20))
    small = 1 << 20  # force sampling: 8 MiB of data > 1 MiB limit
    rev = model_revision(m, full_limit=small)
    _flip(m / "model.safetensors", 10)  # in the last MiB window: always sampled
    assert model_revision(m, full_limit=small) != rev
    assert model_revision(m, full_limit=None) != model_revision(_fake_model(tmp_path / "z", bytes(8 << 20)),
                                                                full_limit=None)


@pytest.mark.unit
def test_revision_prefix_in_both_modes() -> None:
    assert contract.revision_prefix("/kvtier/kv/", "qwen/7b", "abc") == "/kvtier/kv/qwen%2F7b/abc"
    assert contract.revision_prefix("/kvtier/kv", "x", "") == "/kvtier/kv"  # no revision: unchanged layout
    plug = lmcache_config(l2fs_master="h:1", model_revision="r1", namespace="ep")["extra_config"]
    assert plug["remote_storage_plugin.l2fs.prefix"] == "/kvtier/kv/ep/r1"
    assert plug["remote_storage_plugin.l2fs.model_revision"] == "r1"
    mount = lmcache_config(mount_path="/mnt/l2fs", model_revision="r1", namespace="ep")["extra_config"]
    assert mount["remote_storage_plugin.fs.base_path"] == "/mnt/l2fs/kvtier/kv/ep/r1"
    assert resolve_revision("org/hub-name") == ""  # not local: nothing to hash
    assert resolve_revision("x", revision="v7") == "v7"


@pytest.mark.unit
def test_cuda_args_and_env_have_nothing_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    args = vllm_args("/opt/ml/model", device="cuda", host="0.0.0.0", tensor_parallel_size=2,
                     gpu_memory_utilization=0.45)
    assert not set(CPU_ONLY) & set(args)
    assert args[args.index("--dtype") + 1] == "auto" and args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.45"
    assert "--enable-prompt-tokens-details" in args
    assert "LMCacheConnectorV1" in args[args.index("--kv-transfer-config") + 1]
    assert vllm_args("m", device="cuda", dtype="bfloat16")[6:8] == ["--dtype", "bfloat16"]
    env = replica_env("/c.yaml", device="cuda", gpu=GpuSlot((2, 3), 0.9))
    assert not [k for k in env if k.startswith("VLLM_CPU_")] and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert "--distributed-executor-backend" not in args  # a GPU replica keeps vLLM's own choice
    assert env["KVTIER_CPU_CONNECTOR"] == "0"  # connector.cpu_kv stays out: LMCache's CUDA connector
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["PYTHONHASHSEED"] == contract.HASH_SEED
    from connector import cpu_kv

    monkeypatch.setenv("KVTIER_CPU_CONNECTOR", env["KVTIER_CPU_CONNECTOR"])
    assert cpu_kv.install() is False  # the vLLM plugin entry point installs no hook in a cuda replica
    cpu = vllm_args("m")
    assert set(CPU_ONLY) <= set(cpu) and "--enable-prompt-tokens-details" in cpu
    assert cpu[cpu.index("--dtype") + 1] == "float32" and "--tensor-parallel-size" not in cpu
    assert "VLLM_CPU_KVCACHE_SPACE" in replica_env(None) and "KVTIER_CPU_CONNECTOR" not in replica_env(None)
    # one engine process (vLLM's uni executor binds no threads): compute leaves the reserved core to LMCache/l2fs
    cpu_env = replica_env(None)
    assert cpu_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "uni" in cpu
    assert int(cpu_env["OMP_NUM_THREADS"]) == max(1, (os.cpu_count() or 1) - int(cpu_env["VLLM_CPU_NUM_OF_RESERVED_CPU"]))
    for bad in ({"device": "tpu"}, {"dtype": "int8"}, {"tensor_parallel_size": 0}):
        with pytest.raises(ValueError):
            vllm_args("m", **bad)


@pytest.mark.unit
def test_gpu_plan() -> None:
    two = gpu_plan(2, 1, 2)
    assert [s.devices for s in two] == [(0,), (1,)] and {s.memory_utilization for s in two} == {0.9}
    tp = gpu_plan(2, 2, [4, 5, 6, 7])
    assert [s.env()["CUDA_VISIBLE_DEVICES"] for s in tp] == ["4,5", "6,7"]
    assert tp[0].args() == ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9"]
    shared = gpu_plan(2, 1, 1, share=True)
    assert [s.devices for s in shared] == [(0,), (0,)] and [s.memory_utilization for s in shared] == [0.45, 0.45]
    three = gpu_plan(3, 1, 2, share=True)  # GPU 0 carries two replicas, GPU 1 one
    assert [(s.devices, s.memory_utilization) for s in three] == [((0,), 0.45), ((1,), 0.9), ((0,), 0.45)]
    with pytest.raises(ValueError, match="need 2 GPUs, have 1"):
        gpu_plan(2, 1, 1)
    with pytest.raises(ValueError, match="tensor-parallel size 4 needs 4"):
        gpu_plan(1, 4, 2, share=True)
    with pytest.raises(ValueError, match="repeat"):
        gpu_plan(1, 1, [0, 0])
    assert gpu_count() == 0 or detect_device() == "cuda"  # this CPU machine: 0, and no vLLM import needed


def test_mp_adapter_prefix_per_revision() -> None:
    pytest.importorskip("lmcache")
    from connector.mp_l2fs import L2fsL2AdapterConfig

    assert L2fsL2AdapterConfig.from_dict({"master": "h:1"}).prefix == contract.MP_PREFIX
    cfg = L2fsL2AdapterConfig.from_dict({"master": "h:1", "namespace": "ep", "model_revision": "r1"})
    assert cfg.prefix == f"{contract.MP_PREFIX}/ep/r1"


def test_lmcache_config_cli_revision_and_device(tmp_path: Path) -> None:
    m = _fake_model(tmp_path / "m")

    def run(*extra: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "kvtier.cli", "lmcache-config", "--l2fs-master", "h:1",
                            "--format", "json", *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    auto = run("--model", str(m), "--device", "cpu")  # a local --model is hashed by default
    assert auto["lmcache"]["extra_config"]["remote_storage_plugin.l2fs.prefix"] == f"/kvtier/kv/m/{model_revision(m)}"
    out = run("--model", "/opt/ml/model", "--model-revision", "v3", "--namespace", "ep-a", "--device", "cuda",
              "--host", "0.0.0.0", "--tensor-parallel-size", "4", "--dtype", "float16")
    assert out["lmcache"]["extra_config"]["remote_storage_plugin.l2fs.prefix"] == "/kvtier/kv/ep-a/v3"
    assert "--enforce-eager" not in out["args"] and out["args"][out["args"].index("--tensor-parallel-size") + 1] == "4"
    assert "VLLM_CPU_KVCACHE_SPACE" not in out["env"]
    probe = ("import sys; from connector.config import detect_device, gpu_count; print(detect_device(), gpu_count()); "
             "assert not {'vllm', 'lmcache'} & set(sys.modules), 'device detection imported vLLM/LMCache'")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_replicas_of_different_weights_never_share_chunks(tmp_path: Path, tiny_model: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          make_cluster: Callable[..., Any]) -> None:
    """Three replicas, one LMCache model name (/opt/ml/model) and one l2fs: A and C load the same weights
    (C from a copy), B same-architecture weights of another seed. B never hits A's chunks; C hits all."""
    pytest.importorskip("lmcache")
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    from test_connector_l2fs_plugin import _put, _wait_exists

    from connector import keys as ckeys
    from connector.fingerprint import diff, load_records
    from kvtier.devstack.tiny_model import build
    from l2fs.client import NotFound

    name = "/opt/ml/model"  # what every HyperPod endpoint's LMCache sees
    other = build(tmp_path / "seed1", seed=1)  # same architecture (default args), other weights
    copy = shutil.copytree(tiny_model, tmp_path / "copy")
    revs = {d: resolve_revision(str(d)) for d in (tiny_model, other, copy)}
    assert revs[tiny_model] == revs[copy] != revs[other]

    cluster = make_cluster(2)
    client = cluster.client()
    managers: list[StorageManager] = []
    monkeypatch.setenv("PYTHONHASHSEED", contract.HASH_SEED)  # what replica_env gives a real replica

    def records() -> list[dict]:
        try:
            return load_records(client, name)
        except NotFound:  # no replica has published yet
            return []

    def replica(model: Path, rid: str) -> tuple[StorageManager, str]:
        prefix = contract.revision_prefix(contract.KV_PREFIX, "endpoint", revs[model])
        d = lmcache_config(chunk_size=256, l1_gb=0.1, l2fs_master=cluster.master, node_id="node-1",
                           model_revision=revs[model], namespace="endpoint")
        d.pop("remote_serde")
        monkeypatch.setenv("KVTIER_REPLICA_ID", rid)
        md = LMCacheMetadata(model_name=name, world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.float32, kv_shape=(4, 2, 256, 2, 64))
        sm = StorageManager(LMCacheEngineConfig.from_defaults(**d), md, EventManager())
        managers.append(sm)
        t0 = time.monotonic()  # the connector publishes its fingerprint off-thread; wait for it
        while rid not in {r.get("replica") for r in records()}:
            assert time.monotonic() - t0 < 20, f"no fingerprint record from {rid}"
            time.sleep(0.1)
        return sm, prefix

    try:
        a, pa = replica(tiny_model, "rep-a")
        b, pb = replica(other, "rep-b")
        c, pc = replica(copy, "rep-c")
        assert pa == pc != pb
        keys = [CacheEngineKey(model_name=name, world_size=1, worker_id=0, chunk_hash=h, dtype=torch.float32)
                for h in (101, -202, 303)]
        datas = _put(a, keys, seed=3)
        _wait_exists(client, [ckeys.key_path(pa, k) for k in keys])
        assert b.batched_contains(keys)[0] == 0  # same model name, same hashes: still a miss
        assert all(b.get(k) is None for k in keys)
        assert c.batched_contains(keys)[0] == 3
        for k, want in zip(keys, datas, strict=True):
            obj = c.get(k)
            assert obj is not None and torch.equal(obj.tensor, want)
            obj.ref_count_down()
        recs = {r["replica"]: r for r in load_records(client, name)}
        assert recs["rep-a"]["model_revision"] == recs["rep-c"]["model_revision"] == revs[tiny_model]
        assert recs["rep-b"]["model_revision"] == revs[other]
        # one served name, two weights: the key-compat check flags exactly the revision
        assert diff(recs["rep-a"], recs["rep-b"]) == {"model_revision": (revs[tiny_model], revs[other])}
        assert diff(recs["rep-a"], recs["rep-c"]) == {}
    finally:
        for sm in managers:
            sm.close()
        client.close()


def test_same_name_other_revision_is_reported_loudly(caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     make_cluster: Callable[..., Any]) -> None:
    """Two replicas of one served model name with different weights: KVTIER KEY MISMATCH naming the revision."""
    import logging
    from types import SimpleNamespace

    from connector.fingerprint import record_and_check

    caplog.set_level(logging.ERROR, logger="kvtier.connector.fingerprint")
    cfg = SimpleNamespace(chunk_size=256, pre_caching_hash_algorithm="builtin")
    meta = SimpleNamespace(model_name="/opt/ml/model", kv_dtype="torch.bfloat16", chunk_size=256, world_size=1)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    cluster = make_cluster(1)
    client = cluster.client()
    try:
        def publish(replica: str, revision: str) -> set[str]:
            monkeypatch.setenv("KVTIER_REPLICA_ID", replica)
            return {r["replica"] for r in record_and_check(client, cfg, meta, revision=revision)}

        assert publish("old", "aaa") == publish("old-2", "aaa") == set()  # same weights: silent
        assert not [r for r in caplog.records if "KEY MISMATCH" in r.getMessage()]
        assert publish("new", "bbb") == {"old", "old-2"}
        msgs = [r.getMessage() for r in caplog.records if "KVTIER KEY MISMATCH" in r.getMessage()]
        assert msgs and "model_revision: ours='bbb' theirs='aaa'" in msgs[0] and "never loaded" in msgs[0]
    finally:
        client.close()


def test_replicas_sharing_the_cores_split_them_as_torch_reads_it() -> None:
    """replica_env's thread count as torch (the engine's consumer of OMP_NUM_THREADS) reads it: one replica
    without LMCache takes every core; two sharing the machine take half each; with LMCache one core stays
    reserved first. Two replicas of all cores each (OpenMP threads spinning against each other) made the
    workload bench's baseline 2-6x slower (docs/results/2026-12-04-workload-500-threads.md)."""
    import subprocess
    import sys

    cores = os.cpu_count() or 1

    def torch_threads(env: dict[str, str]) -> int:
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return int(r.stdout.split()[-1])

    assert torch_threads(replica_env(None, lmcache=False)) == cores
    assert torch_threads(replica_env(None, lmcache=False, host_share=2)) == max(1, cores // 2)
    assert torch_threads(replica_env(None, host_share=2)) == max(1, (cores - 1) // 2)
