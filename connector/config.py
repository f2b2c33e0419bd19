"""Tier configuration in one place: the LMCache YAML, the vLLM arguments and the env of one replica.

    kvtier lmcache-config [--model M] [--l2fs-master H:P | --mount PATH] [--node-id node-1] [--l1-gb 2]
                          [--chunk-size 256] [--out lmcache.yaml] [--format yaml|env|args|all|json]
    kvtier lmcache-config check --l2fs-master H:P --model M   # key-compat records, exit 1 on mismatch

Why one place: every replica that should share L2 must agree on chunk size, hash algorithm, PYTHONHASHSEED,
model name and dtype (see connector.fingerprint); generating all of it from one function keeps replicas,
`kvtier up`, tests and benchmarks consistent.

L2 choices: `--l2fs-master` uses the native l2fs plugin (connector.lmcache_l2fs); `--mount` points
LMCache's built-in `fs` connector at an l2fs FUSE mount (or any shared directory); neither = L1 only.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from kvtier import contract

HASH_SEED = contract.HASH_SEED
DEFAULT_PREFIX = contract.KV_PREFIX


def lmcache_config(*, chunk_size: int = contract.CHUNK_SIZE, l1_gb: float = 2.0, l2fs_master: str | None = None,
                   mount_path: str | None = None, node_id: str | None = None, prefix: str = DEFAULT_PREFIX,
                   l2_timeout: float = 1.0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The LMCache (in-process, LMCacheConnectorV1) config as a dict (dump it as YAML)."""
    if l2fs_master and mount_path:
        raise ValueError("choose one L2: --l2fs-master or --mount, not both")
    if chunk_size <= 0 or l1_gb <= 0:
        raise ValueError("chunk size and L1 size must be positive")
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
    elif mount_path:
        cfg["remote_storage_plugins"] = ["fs"]
        ex["remote_storage_plugin.fs.base_path"] = str(Path(mount_path) / prefix.strip("/"))
    ex.update(extra or {})
    if not ex:
        del cfg["extra_config"]
    return cfg


def kv_transfer_config() -> str:
    """LMCacheConnectorV1; a chunk that was found but cannot be loaded (corrupt, vanished, L2 down) is
    recomputed instead of failing the request (vLLM's default policy is "fail")."""
    return json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                       "kv_load_failure_policy": "recompute"})


def vllm_args(model: str, *, port: int = 8000, host: str = "127.0.0.1", max_model_len: int = 8192,
              dtype: str = "float32", served_model_name: str | None = None, lmcache: bool = True,
              prefix_caching: bool = False, extra: list[str] | None = None) -> list[str]:
    """Arguments after `python -m vllm.entrypoints.openai.api_server`."""
    args = ["--model", model, "--host", host, "--port", str(port), "--dtype", dtype, "--enforce-eager",
            "--max-model-len", str(max_model_len), "--seed", "0"]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if not prefix_caching:
        # L0 prefix caching off: every repeat then exercises LMCache (L1/L2), which is what we measure
        args.append("--no-enable-prefix-caching")
    if lmcache:
        args += ["--kv-transfer-config", kv_transfer_config()]
    return args + list(extra or [])


def replica_env(config_path: str | Path | None, *, node_id: str | None = None, l2fs_master: str | None = None,
                kv_cache_gb: float = 2.0, lmcache: bool = True) -> dict[str, str]:
    """Environment for a CPU vLLM replica (merge over os.environ)."""
    env = {
        "PYTHONHASHSEED": HASH_SEED,  # LMCache's builtin chunk hash must agree across processes/replicas
        "LMCACHE_TRACK_USAGE": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gb))),
        # vLLM reserves 1 core per KV connector on top of the scheduler's; on a 2-core box keep 1 for compute
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1" if lmcache else "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
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
    p.add_argument("--l2fs-master", required=True)
    p.add_argument("--model", required=True, help="model name as LMCache sees it (the --model path or name)")
    a = p.parse_args(argv)
    from connector.fingerprint import KEY_FIELDS, diff, load_records
    from l2fs.client import Client, L2fsError

    try:
        with Client(a.l2fs_master) as c:
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"]:
        return _check(argv[1:])
    p = argparse.ArgumentParser(prog="kvtier lmcache-config", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="MODEL", help="model path or HF name (for the vLLM args)")
    l2 = p.add_mutually_exclusive_group()
    l2.add_argument("--l2fs-master", help="host:port of the l2fs master (native plugin)")
    l2.add_argument("--mount", help="l2fs FUSE mount path (LMCache's fs connector)")
    p.add_argument("--node-id", help="this replica's node (l2fs local-first placement)")
    p.add_argument("--l1-gb", type=float, default=2.0, help="LMCache L1 (host memory) size, GB")
    p.add_argument("--chunk-size", type=int, default=contract.CHUNK_SIZE)
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="l2fs directory for chunks")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="vLLM CPU KV cache (L0), GB")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--out", type=Path, help="write the YAML here (default: print)")
    p.add_argument("--format", default="all", choices=["yaml", "env", "args", "all", "json"])
    a = p.parse_args(argv)
    try:
        cfg = lmcache_config(chunk_size=a.chunk_size, l1_gb=a.l1_gb, l2fs_master=a.l2fs_master,
                             mount_path=a.mount, node_id=a.node_id, prefix=a.prefix)
    except ValueError as e:
        print(f"kvtier lmcache-config: {e}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(cfg, sort_keys=False)
    cfg_path = a.out.resolve() if a.out else Path("lmcache.yaml")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    env = replica_env(cfg_path, node_id=a.node_id, l2fs_master=a.l2fs_master, kv_cache_gb=a.kv_cache_gb)
    args = vllm_args(a.model, port=a.port, max_model_len=a.max_model_len)
    if a.format == "json":
        print(json.dumps({"lmcache": cfg, "env": env, "args": args}, indent=1))
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
