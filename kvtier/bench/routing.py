"""`kvtier bench routing`: multi-round chat with shared system prompts through each router strategy and
through vllm-router (PyPI, Rust; its cache_aware policy), over real vLLM CPU replicas with LMCache + l2fs.

Every arm gets the same workload shape but fresh system prompts (a per-arm nonce), so that no arm profits from
the KV an earlier arm left behind. Hit rate, load balance and request counts come from the replicas' own
Prometheus counters (deltas over the arm): vLLM prefix-cache hits (L0) and external hits (LMCache L1/L2).
TTFT is measured at the client, streamed, through the router.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench import routing_sim
from kvtier.bench.common import fmt, pct, stream_chat, table, write_results
from kvtier.bench.cross_pod import metric_sum
from kvtier.up import Stack, StackState, log, router_command
from l2fs import procs
from l2fs.common import free_port

OURS = ["roundrobin", "session", "prefixaware", "kvaware"]
VLLM_ROUTER = ["cache_aware", "round_robin"]
COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "l0_hits": "vllm:prefix_cache_hits_total",
    "ext_queries": "vllm:external_prefix_cache_queries_total",
    "ext_hits": "vllm:external_prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
}


def workload(users: int, rounds: int, groups: int, sys_words: int, turn_words: int, nonce: str,
             seed: int) -> list[dict[str, Any]]:
    """users x rounds chat turns; users share one of `groups` system prompts (the reusable prefix).
    Text comes from routing_sim.text(); the nonce makes each arm's prompts new to every cache."""
    text = routing_sim.text
    rng = random.Random(seed)
    systems = [f"[{nonce} group {g}] " + text(rng, sys_words) for g in range(groups)]
    return [{"user": u, "session": f"{nonce}-user-{u}", "system": systems[u % groups],
             "turns": [f"question {r} from user {u}: " + text(rng, turn_words) for r in range(rounds)]}
            for u in range(users)]


def run_user(base_url: str, model: str, user: dict[str, Any], answer_tokens: int,
             results: list[dict[str, Any]], headers: dict[str, str]) -> None:
    """One user's conversation, round after round, each round carrying the whole history."""
    messages = [{"role": "system", "content": user["system"]}]
    with httpx.Client(timeout=600) as http:
        for r, q in enumerate(user["turns"]):
            messages.append({"role": "user", "content": q})
            got = stream_chat(http, base_url, model, messages, answer_tokens, user["session"], exact_length=False,
                              headers=headers)
            results.append({"user": user["user"], "round": r, "ok": got["ok"], "error": got["error"],
                            "sent_at": got["sent_at"], "messages": [dict(m) for m in messages],
                            "ttft_ms": got["ttft_ms"], "prompt_tokens": got["prompt_tokens"],
                            "cached_tokens": got["cached_tokens"], "e2e_ms": got["e2e_ms"]})
            messages.append({"role": "assistant", "content": got["text"] or "ok"})


def counters(urls: list[str]) -> list[dict[str, float | None]]:
    return [{k: metric_sum(u, m) for k, m in COUNTERS.items()} for u in urls]


def start_router(kind: str, policy: str, state: StackState, logdir: Path,
                 extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """One router over the stack's replicas; `extra` goes to kvtier's router only (its own parser reads it)."""
    port = free_port()
    urls = [r.url for r in state.replicas]
    if kind == "kvtier":
        cmd = router_command(",".join(urls), policy, port, state.model, state.l2fs_master, state.kv_events)
        cmd += extra or []
    else:
        exe = Path(sys.executable).with_name("vllm-router")
        # its metrics listener defaults to port 29000: a second vllm-router on the host (another arm's, another
        # run's) exits with 'Address already in use'
        cmd = [str(exe), "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", "--prometheus-port", str(free_port())]
    log_path = logdir / f"router-{kind}-{policy}.log"
    proc = procs.spawn(cmd, log_path)
    url = f"http://127.0.0.1:{port}"
    try:  # kvaware imports LMCache + vLLM hashing: slow on a busy box
        procs.wait_ready(proc, lambda: procs.http_ok(f"{url}/health"), timeout=300, what=f"router {kind} {policy}",
                         log_path=log_path, interval=0.5)
    except BaseException:
        procs.stop(proc)
        raise
    return proc, url


def run_arm(name: str, kind: str, policy: str, state: StackState, args: argparse.Namespace, seed: int,
            logdir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    urls = [r.url for r in state.replicas]
    proc, url = start_router(kind, policy, state, logdir)
    try:
        users = workload(args.users, args.rounds, args.groups, args.system_words, args.turn_words,
                         nonce=f"{name}-{seed}", seed=seed)
        before = counters(urls)
        results: list[dict[str, Any]] = []
        threads = []
        t0 = time.perf_counter()
        for u in users:  # staggered start, then every user runs its rounds back to back
            th = threading.Thread(target=run_user, args=(url, state.model, u, args.answer_tokens, results, {}))
            th.start()
            threads.append(th)
            time.sleep(args.stagger)
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        time.sleep(1.0)  # counters are updated after the response
        after = counters(urls)
    finally:
        procs.stop(proc, grace=10)

    def delta(i: int, k: str) -> float:
        a, b = after[i][k], before[i][k]
        return (a - b) if a is not None and b is not None else 0.0

    per = [{k: delta(i, k) for k in COUNTERS} for i in range(len(urls))]
    reqs = [p["requests"] for p in per]
    mean = sum(reqs) / len(reqs) if reqs else 0
    queries = sum(p["prompt_tokens"] for p in per)
    l0 = sum(p["l0_hits"] for p in per)
    ext = sum(p["ext_hits"] for p in per)
    # Per-request truth when the replicas report it (vLLM --enable-prompt-tokens-details: cached_tokens
    # counts L0 and connector (L1/L2) hits); the counters above can lag the end of an arm.
    ok_rs = [r for r in results if r["ok"]]
    exact = bool(ok_rs) and all(r["cached_tokens"] is not None and r["prompt_tokens"] for r in ok_rs)
    prompt_sum = sum(r["prompt_tokens"] or 0 for r in ok_rs)
    cached_sum = sum(r["cached_tokens"] or 0 for r in ok_rs)
    ttfts = [r["ttft_ms"] for r in results if r["ok"]]
    summary = {
        "arm": name, "requests": len(results), "requests_ok": sum(r["ok"] for r in results),
        "ttft_p50_ms": pct(ttfts, 50), "ttft_p90_ms": pct(ttfts, 90), "wall_s": wall,
        "prompt_tokens": queries, "l0_hit_tokens": l0, "ext_hit_tokens": ext,
        "l0_hit_rate": l0 / queries if queries else None,
        "total_hit_rate": (cached_sum / prompt_sum if exact else (l0 + ext) / queries if queries else None),
        "hit_source": "per-request cached_tokens" if exact else "replica counters (approximate)",
        "per_replica_requests": reqs, "max_over_mean": (max(reqs) / mean) if mean else None,
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }
    oracle = oracle_hit_rate(state.model, results, args.block)
    summary["oracle_hit_rate"] = oracle
    summary["hit_vs_oracle"] = (summary["total_hit_rate"] / oracle
                                if oracle and summary["total_hit_rate"] is not None else None)
    for r in results:
        r["arm"] = name
        r["prompt_messages"] = len(r.pop("messages"))
    return summary, results


def oracle_hit_rate(model: str, results: list[dict[str, Any]], block: int) -> float | None:
    """Best possible cached fraction (routing_sim.Oracle: an infinite cache shared by all replicas), over
    the prompts in the order they were sent, tokenized with the model's own chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    oracle = routing_sim.Oracle(block)
    total = reusable = 0
    for r in sorted((r for r in results if r["ok"]), key=lambda r: r["sent_at"]):
        text = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]  # as vLLM's chat endpoint does
        reusable += oracle.hit(ids)
        total += len(ids)
    return reusable / total if total else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench routing", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4, help="vLLM replicas to start (default 4)")
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--groups", type=int, default=4, help="distinct shared system prompts")
    p.add_argument("--system-words", type=int, default=600)
    p.add_argument("--turn-words", type=int, default=60)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--stagger", type=float, default=0.2, help="seconds between user starts")
    p.add_argument("--strategies", default=",".join(OURS), help="kvtier router strategies to run")
    p.add_argument("--vllm-router", default=",".join(VLLM_ROUTER),
                   help="vllm-router policies to run ('' for none)")
    p.add_argument("--block", type=int, default=128, help="cache block size for the oracle (vLLM CPU: 128)")
    p.add_argument("--quick", action="store_true", help="tiny run for CI: 4 users x 2 rounds, 2 groups")
    p.add_argument("--from-up", type=Path, default=None, help="reuse a running `kvtier up` (<dir>/up.json)")
    p.add_argument("--dir", type=Path, default=Path(".kvtier/bench-routing"))
    p.add_argument("--model", default=None)
    p.add_argument("--l1-gb", type=float, default=0.5, help="LMCache L1 per replica when started here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p


def run_all(state: StackState, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    logdir = Path(state.dir) / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    plan = [(s, "kvtier", s) for s in args.strategies.split(",") if s]
    plan += [(f"vllm-router {p}", "vllm-router", p) for p in args.vllm_router.split(",") if p]
    summaries, raw = [], []
    for i, (name, kind, policy) in enumerate(plan):
        log(f"arm {name}: {args.users} users x {args.rounds} rounds over {len(state.replicas)} replicas")
        try:
            s, r = run_arm(name, kind, policy, state, args, args.seed * 1000 + i, logdir)
        except Exception as e:  # noqa: BLE001 - an arm that cannot start is reported, the others still run
            log(f"arm {name} failed: {e!r}")
            s, r = {"arm": name, "requests": 0, "requests_ok": 0, "errors": [repr(e)]}, []
        summaries.append(s)
        raw += r
    return summaries, raw


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.users, args.rounds, args.groups, args.system_words, args.turn_words = 4, 2, 2, 200, 20
        args.answer_tokens, args.stagger = 4, 0.05
        if args.strategies == ",".join(OURS):
            args.strategies = "roundrobin,prefixaware"
        if args.vllm_router == ",".join(VLLM_ROUTER):
            args.vllm_router = "cache_aware"
    if min(args.users, args.rounds, args.groups, args.replicas) < 1:
        print("kvtier bench routing: --users/--rounds/--groups/--replicas must be >= 1", file=sys.stderr)
        return 2
    if args.from_up:
        state = StackState.load(args.from_up)
        summaries, raw = run_all(state, args)
    else:
        with Stack(args.dir, replicas=args.replicas, workers=2, model=args.model, strategy=None,
                   prefix_caching=True, kv_cache_gb=1.0, l1_gb=args.l1_gb) as stack:
            state = StackState.load(stack.state_path)
            summaries, raw = run_all(state, args)
    rows = [[s["arm"], f"{s['requests_ok']}/{s['requests']}", fmt(s.get("ttft_p50_ms"), 0),
             fmt(s.get("ttft_p90_ms"), 0), fmt(100 * s["l0_hit_rate"], 1) if s.get("l0_hit_rate") is not None else "-",
             fmt(100 * s["total_hit_rate"], 1) if s.get("total_hit_rate") is not None else "-",
             fmt(100 * s["oracle_hit_rate"], 1) if s.get("oracle_hit_rate") is not None else "-",
             fmt(s.get("hit_vs_oracle"), 2), fmt(s.get("max_over_mean"), 2), " ".join(str(int(x)) for x in s.get("per_replica_requests", []))]
            for s in summaries]
    print(table(["arm", "ok/requests", "TTFT p50 ms", "TTFT p90 ms", "L0 hit %", "L0+L1/L2 hit %",
                 "oracle hit %", "hit/oracle", "max/mean load", "requests per replica"], rows,
                title=f"routing: {args.users} users x {args.rounds} rounds, {args.groups} shared system prompts, "
                      f"{len(state.replicas)} replicas (hit % = cached prompt tokens / prompt tokens; source: "
                f"{summaries[0].get('hit_source', '-') if summaries else '-'})"))
    for s in summaries:
        if s.get("errors"):
            print(f"{s['arm']}: errors {s['errors']}")
    for p in write_results(args.out, "routing", {"arms": summaries, "args": vars(args)}, raw):
        print(f"wrote {p}")
    return 0 if all(s["requests_ok"] == s["requests"] > 0 for s in summaries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
