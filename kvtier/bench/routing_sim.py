"""Routing benchmark: cache hit rate vs an oracle, load balance and router overhead, side by side.

Workload: U users x R rounds of multi-round chat; every user shares one of S system prompts; users run
concurrently, each user's rounds in order. Replicas: N `kvtier.devstack.testreplica` processes (block LRU prefix
cache, serialized prefill at a per-token cost, real vLLM-wire KV events), so that 4 "engines" fit on a
small CPU box. Routers compared on the same workload: kvtier (roundrobin, session, prefixaware, kvaware)
and `vllm-router` (Rust; cache_aware, round_robin and kv_aware fed with the same KV events).

Hit rate = sum(cached_tokens reported by the replicas) / sum(prompt tokens). Oracle = an infinite cache
shared by all replicas, i.e. every block any earlier request produced counts as a hit (upper bound).
Balance = max/mean over replicas of requests served and of prefill tokens actually computed.
Overhead: open-loop at --rate req/s, latency via each router minus latency straight to one replica.

    .venv/bin/kvtier bench routing-sim [--users 20 --rounds 5 --replicas 4 --rate 200]

--overhead (router overhead at 200 req/s): only the kvtier strategies, each a fresh router
process, open loop at --rate for --duration s, then the --sweep rates; per request the router's own time
(X-Kvtier-Router-Ms), its tokenization (X-Kvtier-Tokenize-Ms) and end-to-end latency, next to the same
requests sent straight to the replicas at the same rate. The load generator is this process (aiohttp).

    .venv/bin/kvtier bench routing-sim --overhead [--rate 200 --duration 25 --out docs/results/data]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench.common import fmt, pct, table, write_results
from l2fs import procs
from l2fs.common import free_port

# Where the kvtier package lives (a checkout or site-packages): the children's PYTHONPATH and cwd.
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@dataclass
class P:
    """A started test replica or router."""

    proc: subprocess.Popen
    url: str
    kv: str | None = None
    replay: str | None = None
    peers: list[P] = field(default_factory=list)  # further router processes of the same arm (--routers)

    def stop(self) -> None:
        for p in self.peers:
            p.stop()
        procs.stop(self.proc, grace=5)


def spawn(cmd: list[str], log: Path, pattern: str | None, url: str | None = None, timeout: float = 60) -> P:
    """Start a replica or router; ready once it printed its URL (pattern group 1, else url) and /health is 200."""
    proc = procs.spawn(cmd, log, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, append=False)
    found = procs.log_match(log, pattern) if pattern else (lambda: url)

    def ready() -> str | None:
        u = found()
        return u if u and procs.http_ok(u + "/health", timeout=1) else None

    try:
        return P(proc, procs.wait_ready(proc, ready, timeout=timeout, what=" ".join(cmd[:3]), log_path=log,
                                        interval=0.2))
    except BaseException:
        procs.stop(proc, grace=5)
        raise


# -- workload -------------------------------------------------------------------------------------
WORDS = ("cache token model prefix node replica router block engine memory tier storage latency the a of "
         "and to in is for with on at by from").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def render(messages: list[dict[str, str]]) -> list[int]:
    """Exactly what router.tokens('bytes') and the test replica tokenize for a chat request."""
    from router.tokens import _bytes_chat

    return list(_bytes_chat(messages).encode())


class Oracle:
    """Infinite cache shared by every replica: the best hit any routing could get."""

    def __init__(self, bs: int) -> None:
        self.bs, self.seen = bs, set()

    def hit(self, tokens: list[int]) -> int:
        from router.index import block_keys

        keys = block_keys(tokens, self.bs)
        n = 0
        for k in keys:
            if k not in self.seen:
                break
            n += 1
        self.seen.update(keys)
        cached = n * self.bs
        return max(0, cached - self.bs) if cached >= len(tokens) else cached


async def run_chat(urls: list[str], args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The chat workload; with several URLs (router processes) the client round-robins them per request."""
    rng = random.Random(args.seed)
    sent = itertools.count()
    systems = [text(rng, args.system_words) for _ in range(args.systems)]
    oracle = Oracle(args.block_size)
    stats = {"prompt": 0, "cached": 0, "oracle": 0, "lat": [], "errors": 0, "n": 0}
    lock = asyncio.Lock()

    async def user(u: int, client: httpx.AsyncClient) -> None:
        urng = random.Random(args.seed * 1000 + u)
        msgs = [{"role": "system", "content": systems[u % args.systems]}]
        await asyncio.sleep(urng.random() * 0.5)
        for _ in range(args.rounds):
            msgs.append({"role": "user", "content": text(urng, args.question_words)})
            async with lock:
                stats["oracle"] += oracle.hit(render(msgs))
            t0 = time.perf_counter()
            try:
                r = await client.post(urls[next(sent) % len(urls)] + "/v1/chat/completions", json={
                    "model": model, "messages": msgs, "max_tokens": args.max_tokens, "user": f"user-{u}"},
                    headers={"x-session-id": f"user-{u}"})
            except httpx.HTTPError:
                r = None
            stats["lat"].append(time.perf_counter() - t0)
            stats["n"] += 1
            if r is None or r.status_code != 200:
                stats["errors"] += 1
                msgs.pop()
                continue
            body = r.json()
            usage = body["usage"]
            stats["prompt"] += usage["prompt_tokens"]
            stats["cached"] += usage["prompt_tokens_details"]["cached_tokens"]
            msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(user(u, client) for u in range(args.users)))
        stats["wall"] = time.perf_counter() - t0
    return stats


async def run_open_loop(urls: list[str], n: int, rate: float, model: str, prompts: list[str]) -> list[float]:
    """Open loop at `rate` req/s; with several URLs the client itself round-robins (the no-router baseline)."""
    lat: list[float] = []
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=400)) as client:
        async def one(i: int) -> None:
            t0 = time.perf_counter()
            url = urls[i % len(urls)]
            try:
                r = await client.post(url + "/v1/completions",
                                      json={"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": 1})
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                lat.append(time.perf_counter() - t0)

        # warm-up: connections and the tokenizer cache ("excluding cold tokenization")
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        lat.clear()
        tasks = []
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return lat


async def run_serial(urls: list[str], n: int, model: str, prompts: list[str]) -> list[float]:
    """One request at a time: the latency a router adds when nothing queues."""
    lat: list[float] = []
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(n + 20):
            t0 = time.perf_counter()
            r = await client.post(urls[i % len(urls)] + "/v1/completions",
                                  json={"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": 1})
            if r.status_code == 200 and i >= 20:  # the first 20 warm connections and caches
                lat.append(time.perf_counter() - t0)
    return lat


def replica_stats(reps: list[P]) -> list[dict[str, Any]]:
    return [httpx.get(r.url + "/admin/stats", timeout=5).json() for r in reps]


def reset(reps: list[P]) -> None:
    for r in reps:
        httpx.post(r.url + "/reset_prefix_cache", timeout=5)


def set_cost(reps: list[P], prefill_us: float, decode_ms: float) -> None:
    for r in reps:
        httpx.post(r.url + "/admin/config", json={"prefill_us_per_token": prefill_us,
                                                  "decode_ms_per_token": decode_ms}, timeout=5)


def hist_quantile(text: str, name: str, q: float) -> float:
    """Upper bucket bound of quantile q from a Prometheus histogram exposition (seconds)."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    total = buckets[-1][1]
    return next(le for le, c in buckets if c >= q * total)


# -- overhead mode: open loop at a fixed rate, the router's own time per request, direct baseline --------
def overhead_requests(args: argparse.Namespace, n: int, model: str, seed: int) -> list[tuple[str, bytes]]:
    """n distinct multi-round chat requests (session id, JSON body). Users share args.systems system
    prompts; blocks of 50 users take turns round by round, each round carrying the history, so every
    prompt is new to the router's tokenizer cache (all tokenization is cold; it is reported separately)."""
    rng = random.Random(seed)
    systems = [text(rng, args.system_words) for _ in range(args.systems)]
    answer = " ".join(f"t{i}" for i in range(args.max_tokens))
    out: list[tuple[str, bytes]] = []
    u0 = 0
    while len(out) < n:
        convs = [[{"role": "system", "content": systems[(u0 + k) % args.systems]}] for k in range(50)]
        for _ in range(args.rounds):
            for k, msgs in enumerate(convs):
                user = f"user-{seed}-{u0 + k}"
                msgs.append({"role": "user", "content": text(rng, args.question_words)})
                out.append((user, json.dumps({"model": model, "messages": msgs, "max_tokens": args.max_tokens,
                                              "user": user}).encode()))
                msgs.append({"role": "assistant", "content": answer})
        u0 += 50
    return out[:n]


async def open_loop_run(urls: list[str], reqs: list[tuple[str, bytes]], rate: float,
                        warm: list[tuple[str, bytes]]) -> tuple[list[dict[str, Any]], float]:
    """Send reqs on a fixed schedule (request i at start + i/rate, never waiting for earlier answers),
    round-robin over urls. Latency counts from the scheduled time, so a late sender cannot hide queueing."""
    import aiohttp

    rows: list[dict[str, Any]] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as http:
        async def one(i: int, sid: str, body: bytes, t_sched: float, rec: bool) -> None:
            t_send = time.perf_counter()
            status, h = 0, {}
            try:
                async with http.post(urls[i % len(urls)] + "/v1/chat/completions", data=body, headers={
                        "content-type": "application/json", "x-session-id": sid}) as r:
                    await r.read()
                    status, h = r.status, r.headers
            except (TimeoutError, aiohttp.ClientError):
                pass
            t_done = time.perf_counter()
            if rec:
                rows.append({"i": i, "sched_s": t_sched - start, "lag_ms": (t_send - t_sched) * 1e3,
                             "e2e_ms": (t_done - t_sched) * 1e3, "done_s": t_done - start, "status": status,
                             "router_ms": float(h.get("x-kvtier-router-ms", "nan")),
                             "tokenize_ms": float(h.get("x-kvtier-tokenize-ms", "nan")),
                             "replica": h.get("x-kvtier-replica", urls[i % len(urls)]),
                             "pid": h.get("x-kvtier-router-pid")})

        start = time.perf_counter()  # warm-up: connections, code paths (its prompts are not reused)
        await asyncio.gather(*(one(i, sid, b, start, False) for i, (sid, b) in enumerate(warm)))
        start = time.perf_counter() + 0.05
        tasks = []
        for i, (sid, body) in enumerate(reqs):
            t = start + i / rate
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, sid, body, t, True)))
        sent_s = time.perf_counter() - start
        await asyncio.gather(*tasks)
    return rows, sent_s


def overhead_summary(arm: str, rate: float, rows: list[dict[str, Any]], sent_s: float, load: float,
                     sustain_p99_ms: float) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == 200]
    # a 429's client-side time: from the actual send (not the schedule: the client's own lag is not the router's)
    rej = [r["e2e_ms"] - r["lag_ms"] for r in rows if r["status"] == 429]
    e2e = [r["e2e_ms"] for r in ok]
    own = [r["router_ms"] for r in ok if r["router_ms"] == r["router_ms"]]
    tok = [r["tokenize_ms"] for r in ok if r["tokenize_ms"] == r["tokenize_ms"]]
    last = max((r["done_s"] for r in ok), default=float("nan"))
    s = {"arm": arm, "target_rps": rate, "n": len(rows), "ok": len(ok), "errors": len(rows) - len(ok),
         "sent_rps": len(rows) / sent_s if sent_s > 0 else float("nan"), "done_rps": len(ok) / last if ok else 0.0,
         "lag_p99_ms": pct([r["lag_ms"] for r in rows], 99),
         "router_p50_ms": pct(own, 50), "router_p99_ms": pct(own, 99), "router_max_ms": max(own, default=None),
         "tok_p50_ms": pct(tok, 50), "tok_p99_ms": pct(tok, 99),
         "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99), "load1": load,
         "n429": len(rej), "reject_p50_ms": pct(rej, 50), "reject_p99_ms": pct(rej, 99),
         "pids": len({r.get("pid") for r in ok} - {None}),
         "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    s["sustained"] = (s["errors"] == 0 and s["sent_rps"] >= 0.95 * rate and s["done_rps"] >= 0.95 * rate
                      and s["e2e_p99_ms"] <= sustain_p99_ms)
    return s


def overhead(args: argparse.Namespace, tmp: Path, reps: list[P], model: str, running: list[P]) -> int:
    """--overhead: per strategy, a fresh `kvtier router` process in front of the replicas, open loop at
    --rate for --duration s (then the --sweep rates for --sweep-duration s each); the same requests sent
    straight to the replicas (client round-robin) are the baseline, rate for rate."""
    set_cost(reps, 0, 0)  # replicas answer at once: latency is transport + router
    # ascending; above the first rate that overloads an arm only --rate itself is still run (no long drains)
    rates = sorted({args.rate, *(float(x) for x in args.sweep.split(",") if x.strip())})
    durs = [args.duration if r == args.rate else args.sweep_duration for r in rates]
    pool = overhead_requests(args, sum(int(r * d) for r, d in zip(rates, durs, strict=True)), model, args.seed)
    warm = overhead_requests(args, 100, model, args.seed + 10_000)
    names = ["direct"] + [s for s in args.strategies.split(",") if s]
    arms = names * max(1, args.repeats)  # interleaved: every arm once, then again (the box's load drifts)
    summaries: list[dict[str, Any]] = []
    with (tmp / "overhead-requests.csv").open("w") as raw_f:
        raw_f.write("arm,target_rps,i,sched_s,lag_ms,e2e_ms,status,router_ms,tokenize_ms,replica,router_pid\n")
        for arm in arms:
            rt = None
            if arm.startswith("vllm-router:"):
                rt = start_vllm_router(args, tmp, reps, model, arm.split(":", 1)[1])
                running.append(rt)
            elif arm != "direct":
                # KV events only where the strategy reads them (a kvaware deployment's flags); "<strategy>@N":
                # that strategy with --workers N (N router processes on one port); "<strategy>+haproxy": with
                # --data-path haproxy (haproxy carries the requests, the router picks)
                strategy, _, nw = arm.partition("@")
                strategy, _, via = strategy.partition("+")
                rt = start_kvtier(args, tmp, reps, strategy, kv=strategy == "kvaware" or args.kv_events_all,
                                  workers=int(nw or 1), data_path=via or "python")
                running.append(rt)
            urls = [r.url for r in reps] if rt is None else [rt.url]
            off = 0
            failed = False
            for k, (rate, dur) in enumerate(zip(rates, durs, strict=True)):
                n = int(rate * dur)
                if failed and rate != args.rate:
                    off += n
                    continue
                reset(reps)
                time.sleep(1.0)
                load = os.getloadavg()[0]
                c0 = [cpu_seconds(p.proc.pid) for p in ([rt] if rt else []) + reps]
                gc0 = gc_pauses(rt.url) if rt else None
                t0, g0 = time.perf_counter(), time.process_time()
                rows, sent_s = asyncio.run(open_loop_run(urls, pool[off:off + n], rate, warm if k == 0 else []))
                cpu = [(cpu_seconds(p.proc.pid) - c) / (time.perf_counter() - t0) * 100
                       for p, c in zip(([rt] if rt else []) + reps, c0, strict=True)]
                off += n
                s = overhead_summary(arm, rate, rows, sent_s, load, args.sustain_p99_ms)
                s["router_cpu_pct"] = cpu[0] if rt else None
                s["replicas_cpu_pct"] = sum(cpu[1:] if rt else cpu)
                s["loadgen_cpu_pct"] = (time.process_time() - g0) / (time.perf_counter() - t0) * 100
                gc1 = gc_pauses(rt.url) if rt and gc0 else None
                s["gc_ms"], s["gc_full"], s["gc_over_10ms"] = (
                    [(b - a) * k for a, b, k in zip(gc0, gc1, (1000, 1, 1), strict=True)] if gc0 and gc1
                    else [None, None, None])
                summaries.append(s)
                failed = failed or s["errors"] > 0 or s["done_rps"] < 0.9 * rate  # overloaded: stop climbing
                print(f"# {arm} @ {rate:.0f}/s: sent {s['sent_rps']:.1f}/s done {s['done_rps']:.1f}/s "
                      f"err {s['errors']} router p50/p99 {fmt(s['router_p50_ms'], 3)}/{fmt(s['router_p99_ms'], 3)} "
                      f"ms e2e p50/p99 {s['e2e_p50_ms']:.2f}/{s['e2e_p99_ms']:.2f} ms load {load:.2f}", flush=True)
                for r in rows:
                    raw_f.write(f"{arm},{rate},{r['i']},{r['sched_s']:.6f},{r['lag_ms']:.3f},{r['e2e_ms']:.3f},"
                                f"{r['status']},{r['router_ms']},{r['tokenize_ms']},{r['replica']},{r['pid'] or ''}\n")
            if rt is not None:
                rt.stop()
                running.remove(rt)
    direct = {s["target_rps"]: s for s in summaries if s["arm"] == "direct"}
    for s in summaries:  # only where neither side lost requests (percentiles of survivors do not compare)
        d = direct.get(s["target_rps"])
        both = d is not None and d["errors"] == 0 and s["errors"] == 0
        s["minus_direct_p50_ms"] = s["e2e_p50_ms"] - d["e2e_p50_ms"] if both else float("nan")
        s["minus_direct_p99_ms"] = s["e2e_p99_ms"] - d["e2e_p99_ms"] if both else float("nan")
    cols = [("arm", "arm"), ("target_rps", "target/s"), ("sent_rps", "sent/s"), ("done_rps", "done/s"),
            ("ok", "ok"), ("errors", "err"), ("lag_p99_ms", "send lag p99"),
            ("router_p50_ms", "router p50"), ("router_p99_ms", "router p99"), ("tok_p50_ms", "tok p50"),
            ("tok_p99_ms", "tok p99"), ("e2e_p50_ms", "e2e p50"), ("e2e_p99_ms", "e2e p99"),
            ("minus_direct_p50_ms", "-direct p50"), ("minus_direct_p99_ms", "-direct p99"),
            ("n429", "429s"), ("reject_p50_ms", "429 ms p50"), ("reject_p99_ms", "429 ms p99"),
            ("pids", "router pids"), ("router_cpu_pct", "router cpu%"), ("replicas_cpu_pct", "4 replicas cpu%"),
            ("loadgen_cpu_pct", "loadgen cpu%"), ("gc_ms", "router gc ms"), ("gc_full", "full gcs"),
            ("gc_over_10ms", "gc pauses > 10 ms"), ("load1", "load1"),
            ("sustained", "sustained")]

    def cell(k: str, v: Any) -> str:
        if isinstance(v, bool):
            return "yes" if v else "no"
        if k in ("target_rps", "sent_rps", "done_rps", "load1") or k.endswith("pct"):
            return fmt(v, 1)
        return fmt(v, 3 if k.startswith(("router", "tok")) else 2)

    order = sorted(summaries, key=lambda s: (s["target_rps"] != args.rate, s["target_rps"], names.index(s["arm"])))
    print(f"\n# router overhead, open loop, {args.replicas} zero-cost test replicas, chat requests "
          f"({args.systems} shared system prompts of ~{args.system_words} words, {args.rounds} rounds, "
          f"max_tokens {args.max_tokens}); all times ms; KV events fed to "
          f"{'every router' if args.kv_events_all else 'the kvaware router only'}; cpu% of one core, over the run "
          "(warm-up included on the first rate)")
    print("# router = X-Kvtier-Router-Ms (the router's own time: body read to response headers, minus tokenization "
          "and minus every wait on the replica); tok = X-Kvtier-Tokenize-Ms (cold: every prompt is new); "
          "e2e from the scheduled send time; -direct = e2e minus the same requests sent straight to the replicas "
          f"at the same rate (only where neither lost requests; e2e is over answered requests); sustained = no errors, sent and done >= 95% of target, e2e p99 <= "
          f"{args.sustain_p99_ms:.0f} ms; router gc = the kvtier router's garbage-collection pauses during the run "
          "(its kvtier_router_gc_pause_seconds: total ms, full collections, pauses over 10 ms)")
    print(table([c[1] for c in cols], [[cell(k, s[k]) for k, _ in cols] for s in order]))
    print("\n# highest rate sustained (of those tried)")
    for arm in names:
        ok = [s["target_rps"] for s in summaries if s["arm"] == arm and s["sustained"]]
        print(f"  {arm:<12} {max(ok):.0f} req/s" if ok else f"  {arm:<12} none of {sorted(rates)}")
    if args.out:
        for p in write_results(args.out, "routing-overhead", {"rows": summaries, "args": vars(args)}, summaries):
            print(f"wrote {p}")
    print(f"(logs and per-request rows in {tmp})")
    return 0


def start_replicas(args: argparse.Namespace, tmp: Path, model: str, running: list[P]) -> list[P]:
    """args.replicas test replicas with KV events + replay (appended to running as they start)."""
    reps = []
    for i in range(args.replicas):
        ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        p = spawn([PY, "-m", "kvtier.devstack.testreplica", "--port", "0", "--model", model, "--kv-events", ev,
                   "--kv-replay", rp, "--block-size", str(args.block_size),
                   "--capacity-blocks", str(args.capacity_blocks),
                   "--prefill-us-per-token", str(args.prefill_us_per_token),
                   "--decode-ms-per-token", str(args.decode_ms_per_token)],
                  tmp / f"rep{i}.log", r"listening on (http://\S+)")
        p.kv, p.replay = ev, rp
        reps.append(p)
        running.append(p)
    return reps


def start_kvtier(args: argparse.Namespace, tmp: Path, reps: list[P], strategy: str, kv: bool = True,
                 workers: int = 1, data_path: str = "python") -> P:
    """`kvtier router` (router.cli: the production uvicorn settings) in front of reps, fed their KV events."""
    events = ["--kv-events", ",".join(r.kv for r in reps), "--kv-replay", ",".join(r.replay for r in reps)]
    extra = shlex.split(getattr(args, "router_args", "") or "") + (["--workers", str(workers)] if workers > 1 else [])
    extra += ["--data-path", data_path] if data_path != "python" else []

    def one(i: int) -> P:
        return spawn([PY, "-m", "router.cli", "--port", "0", "--replicas", ",".join(r.url for r in reps),
                      "--strategy", strategy, "--block-size", str(args.block_size), *(events if kv else []),
                      "--log-level", "warning", "--tokenizer", "bytes", *extra], tmp / f"kvtier-{strategy}-{data_path}-{i}.log",
                     r"listening on (http://\S+)")

    rt = one(0)
    try:  # --routers N: N independent processes, each with its own state (peers stop with the first)
        rt.peers = [one(i) for i in range(1, max(1, getattr(args, "routers", 1)))]
    except BaseException:
        rt.stop()
        raise
    return rt


def start_vllm_router(args: argparse.Namespace, tmp: Path, reps: list[P], model: str, policy: str) -> P:
    """The Rust `vllm-router` (pip extra `bench`) with one --policy in front of reps."""
    exe = shutil.which("vllm-router") or str(Path(PY).parent / "vllm-router")
    port = free_port()
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls",
           *[r.url for r in reps], "--log-level", "warning", "--prometheus-port", str(free_port())]
    if policy == "kv_aware":
        for r in reps:
            cmd += ["--kv-event-source", f"{r.url}={r.kv}", "--kv-event-replay-source", f"{r.url}={r.replay}"]
        cmd += ["--kv-event-block-size", str(args.block_size), "--kv-event-model", model]
    return spawn(cmd, tmp / f"vllm-router-{policy}.log", None, url=f"http://127.0.0.1:{port}")


def gc_pauses(url: str) -> tuple[float, float, float] | None:
    """What the kvtier router's garbage collections took so far (its kvtier_router_gc_pause_seconds, every
    worker's when several): seconds, full collections, pauses over 10 ms. None where it has no such metric."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    seconds = full = over = 0.0
    found = False
    for fam in text_string_to_metric_families(text):
        if fam.name != "kvtier_router_gc_pause_seconds":
            continue
        found = True
        for smp in fam.samples:
            if smp.name.endswith("_sum"):
                seconds += smp.value
            elif smp.name.endswith("_count"):
                over += smp.value
                full += smp.value if smp.labels.get("generation") == "2" else 0.0
            elif smp.name.endswith("_bucket") and float(smp.labels.get("le", "nan")) == 0.01:
                over -= smp.value
    return (seconds, full, over) if found else None


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its live descendants (a `--workers N` router's workers; Linux /proc)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # gone meanwhile
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK") + sum(cpu_seconds(int(k)) for k in kids)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier bench routing-sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--systems", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--question-words", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--capacity-blocks", type=int, default=4096)
    ap.add_argument("--prefill-us-per-token", type=float, default=20.0)
    ap.add_argument("--decode-ms-per-token", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--overhead-requests", type=int, default=1000)
    ap.add_argument("--serial-requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-vllm-router", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated subset of router configs to run")
    ap.add_argument("--skip-chat", action="store_true", help="overhead phase only")
    ap.add_argument("--overhead", action="store_true",
                    help="overhead mode only: open loop at --rate per strategy vs straight to the replicas")
    ap.add_argument("--duration", type=float, default=25.0, help="--overhead: seconds at --rate")
    ap.add_argument("--sweep", default="25,50,100,150,300", help="--overhead: further rates ('' for none)")
    ap.add_argument("--sweep-duration", type=float, default=8.0)
    ap.add_argument("--strategies", default="roundrobin,session,prefixaware,kvaware",
                    help="--overhead arms: kvtier strategies (<strategy>+haproxy: --data-path haproxy; <strategy>@N: "
                         "--workers N) and vllm-router:<policy> (e.g. vllm-router:cache_aware)")
    ap.add_argument("--routers", type=int, default=1,
                    help="chat mode: N kvtier router processes per arm, the client round-robins them per request")
    ap.add_argument("--router-args", default="", help="extra flags for every kvtier router (one string)")
    ap.add_argument("--repeats", type=int, default=1, help="--overhead: run every arm this often, interleaved")
    ap.add_argument("--sustain-p99-ms", type=float, default=100.0,
                    help="--overhead: a rate counts as sustained only with e2e p99 at most this")
    ap.add_argument("--kv-events-all", action="store_true",
                    help="--overhead: feed KV events to every strategy's router (default: kvaware only)")
    ap.add_argument("--out", type=Path, default=None, help="--overhead: write routing-overhead.json/.csv here")
    return ap


def router_configs(args: argparse.Namespace, tmp: Path, reps: list[P], model: str) -> list[tuple[str, Any]]:
    """(name, start function) of every router compared: the kvtier strategies, then vllm-router's policies."""

    def kvtier(strategy: str) -> P:
        return start_kvtier(args, tmp, reps, strategy)

    def vllm_router(policy: str) -> P:
        return start_vllm_router(args, tmp, reps, model, policy)

    configs: list[tuple[str, Any]] = [(f"kvtier {s}", lambda s=s: kvtier(s))
                                      for s in ("roundrobin", "session", "prefixaware", "kvaware")]
    if not args.skip_vllm_router:
        configs += [(f"vllm-router {p}", lambda p=p: vllm_router(p))
                    for p in ("round_robin", "cache_aware", "kv_aware")]
    if args.only:
        keep = {x.strip() for x in args.only.split(",")}
        configs = [c for c in configs if c[0] in keep]
    return configs


def prediction(urls: list[str]) -> tuple[float, float]:
    """(precision, recall) of the kvtier routers' cached-token predictions over everything they routed so far,
    summed over the router processes (router/accounting.py: tier "all"); NaN where nothing was predicted."""
    tot = dict.fromkeys(("matched", "predicted", "actual"), 0.0)
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=5).text.splitlines():
            for k in tot:
                if line.startswith(f'kvtier_router_cache_{k}_tokens_total{{tier="all"}} '):
                    tot[k] += float(line.rsplit(" ", 1)[1])
    return (tot["matched"] / tot["predicted"] if tot["predicted"] else float("nan"),
            tot["matched"] / tot["actual"] if tot["actual"] else float("nan"))


def measure_router(name: str, rt: P, reps: list[P], args: argparse.Namespace, model: str, prompts: list[str],
                   direct_lat: list[float], direct_serial: list[float]) -> dict[str, Any]:
    """One router's row: the chat workload (hit rate, balance), then open-loop and serial overhead."""
    before = replica_stats(reps)
    res = asyncio.run(run_chat([rt.url, *(x.url for x in rt.peers)], args if not args.skip_chat else argparse.Namespace(
        **{**vars(args), "users": 1, "rounds": 1}), model))
    after = replica_stats(reps)
    prec = prediction([rt.url, *(x.url for x in rt.peers)]) if name.startswith("kvtier") else (float("nan"),) * 2
    served = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
    computed = [(a["prompt_tokens"] - b["prompt_tokens"]) - (a["cached_tokens"] - b["cached_tokens"])
                for a, b in zip(after, before, strict=True)]
    reset(reps)
    set_cost(reps, 0, 0)
    ol = asyncio.run(run_open_loop([rt.url], args.overhead_requests, args.rate, model, prompts))
    ser = asyncio.run(run_serial([rt.url], args.serial_requests, model, prompts))
    set_cost(reps, args.prefill_us_per_token, args.decode_ms_per_token)
    internal = (float("nan"), float("nan"))
    if name.startswith("kvtier"):
        mtext = httpx.get(rt.url + "/metrics", timeout=5).text
        internal = tuple(hist_quantile(mtext, "kvtier_router_overhead_seconds", q) * 1e3 for q in (.5, .99))
    hit = res["cached"] / max(1, res["prompt"])
    orc = res["oracle"] / max(1, res["prompt"])
    return {
        "router": name, "reqs": res["n"], "err": res["errors"], "hit": hit, "oracle": orc,
        "hit/oracle": hit / orc if orc else float("nan"), "precision": prec[0], "recall": prec[1],
        "req max/mean": max(served) / statistics.mean(served) if sum(served) else float("nan"),
        "prefill max/mean": max(computed) / statistics.mean(computed) if sum(computed) else float("nan"),
        "lat p50 ms": pct(res["lat"], 50) * 1e3, "lat p99 ms": pct(res["lat"], 99) * 1e3,
        "wall s": res["wall"], "served": "/".join(map(str, served)),
        "ovh p50 ms": (pct(ol, 50) - pct(direct_lat, 50)) * 1e3,
        "ovh p99 ms": (pct(ol, 99) - pct(direct_lat, 99)) * 1e3,
        "via p50 ms": pct(ol, 50) * 1e3, "via p99 ms": pct(ol, 99) * 1e3, "ol n": len(ol),
        "int p50 ms<=": internal[0], "int p99 ms<=": internal[1],
        "serial +p50 ms": (pct(ser, 50) - pct(direct_serial, 50)) * 1e3,
        "serial +p99 ms": (pct(ser, 99) - pct(direct_serial, 99)) * 1e3,
    }


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]], direct_lat: list[float],
                 direct_serial: list[float], tmp: Path) -> None:
    """The comparison table (markdown) and each router's ratios against kvtier roundrobin."""
    print(f"\n# routing bench: {args.users} users x {args.rounds} rounds, {args.systems} shared system prompts "
          f"(~{args.system_words} words), {args.replicas} test replicas, block {args.block_size}, "
          f"prefill {args.prefill_us_per_token} us/token, decode {args.decode_ms_per_token} ms/token; "
          f"{args.routers} process(es) per kvtier router, client round-robin; kvtier flags: {args.router_args!r}")
    print("# overhead: open loop, zero-cost replicas; 'via' = through the router, 'ovh' = via minus the "
          "client round-robining the replicas itself; 'int' = kvtier's own pre-send histogram (bucket bound)")
    print("# precision / recall: the kvtier router's predicted cached tokens vs the engines' reported ones over "
          "the chat workload (sum min / sum predicted, sum min / sum actual; roundrobin predicts nothing)")
    print(f"# serial (one at a time, zero-cost replicas) direct: p50 {pct(direct_serial, 50)*1e3:.2f} ms, "
          f"p99 {pct(direct_serial, 99)*1e3:.2f} ms; 'serial +' = added by the router")
    print(f"# direct (client round-robin) at {args.rate:.0f} req/s: p50 {pct(direct_lat, 50)*1e3:.2f} ms, "
          f"p99 {pct(direct_lat, 99)*1e3:.2f} ms (n={len(direct_lat)})")
    cols = ["router", "reqs", "err", "hit", "oracle", "hit/oracle", "precision", "recall", "req max/mean", "prefill max/mean",
            "lat p50 ms", "lat p99 ms", "wall s", "served", "via p50 ms", "via p99 ms", "ovh p50 ms",
            "ovh p99 ms", "ol n", "int p50 ms<=", "int p99 ms<=", "serial +p50 ms", "serial +p99 ms"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    base = next((r for r in rows if r["router"] == "kvtier roundrobin"), None)
    if base:
        print("\n# vs kvtier roundrobin (hit-rate ratio, p50 latency ratio)")
        for r in rows:
            print(f"  {r['router']:<26} hit x{r['hit'] / max(base['hit'], 1e-9):.2f}  "
                  f"lat p50 x{r['lat p50 ms'] / base['lat p50 ms']:.2f}")
    print(f"\n(logs in {tmp})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    model = "test-model"
    running: list[P] = []
    try:
        reps = start_replicas(args, tmp, model, running)
        if args.overhead:
            return overhead(args, tmp, reps, model, running)
        prompts = [text(random.Random(i), 60) for i in range(50)]
        set_cost(reps, 0, 0)  # overhead phase: replicas answer at once, so latency is transport + router
        direct_lat = asyncio.run(run_open_loop([r.url for r in reps], args.overhead_requests, args.rate, model,
                                               prompts))
        direct_serial = asyncio.run(run_serial([r.url for r in reps], args.serial_requests, model, prompts))
        set_cost(reps, args.prefill_us_per_token, args.decode_ms_per_token)
        rows = []
        for name, make in router_configs(args, tmp, reps, model):
            reset(reps)
            try:
                rt = make()
            except RuntimeError as e:
                print(f"# {name}: could not start ({str(e).splitlines()[0][:200]})")
                continue
            running.append(rt)
            rows.append(measure_router(name, rt, reps, args, model, prompts, direct_lat, direct_serial))
            rt.stop()
            running.remove(rt)
        print_report(args, rows, direct_lat, direct_serial, tmp)
    finally:
        for p in running:
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
