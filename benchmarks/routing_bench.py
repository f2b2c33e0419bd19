"""Routing benchmark: cache hit rate vs an oracle, load balance and router overhead, side by side.

Workload: U users x R rounds of multi-round chat; every user shares one of S system prompts; users run
concurrently, each user's rounds in order. Replicas: N `router.testreplica` processes (block LRU prefix
cache, serialized prefill at a per-token cost, real vLLM-wire KV events), so that 4 "engines" fit on a
small CPU box. Routers compared on the same workload: kvtier (roundrobin, session, prefixaware, kvaware)
and `vllm-router` (Rust; cache_aware, round_robin and kv_aware fed with the same KV events).

Hit rate = sum(cached_tokens reported by the replicas) / sum(prompt tokens). Oracle = an infinite cache
shared by all replicas, i.e. every block any earlier request produced counts as a hit (upper bound).
Balance = max/mean over replicas of requests served and of prefill tokens actually computed.
Overhead: open-loop at --rate req/s, latency via each router minus latency straight to one replica.

    .venv/bin/python benchmarks/routing_bench.py [--users 20 --rounds 5 --replicas 4 --rate 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class P:
    proc: subprocess.Popen
    url: str
    kv: str | None = None
    replay: str | None = None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def spawn(cmd: list[str], log: Path, pattern: str | None, url: str | None = None, timeout: float = 60) -> P:
    f = open(log, "w")  # noqa: SIM115
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"))
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if p.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited: {log.read_text()[-2000:]}")
        if pattern:
            m = re.search(pattern, log.read_text(errors="replace"))
            if m:
                url = m.group(1)
        if url:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return P(p, url)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    p.kill()
    raise RuntimeError(f"{cmd[:3]} did not start: {log.read_text()[-2000:]}")


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


async def run_chat(url: str, args: argparse.Namespace, model: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
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
                r = await client.post(url + "/v1/chat/completions", json={
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


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    model = "test-model"
    procs: list[P] = []
    try:
        reps = []
        for i in range(args.replicas):
            ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            p = spawn([PY, "-m", "router.testreplica", "--port", "0", "--model", model, "--kv-events", ev,
                       "--kv-replay", rp, "--block-size", str(args.block_size),
                       "--capacity-blocks", str(args.capacity_blocks),
                       "--prefill-us-per-token", str(args.prefill_us_per_token),
                       "--decode-ms-per-token", str(args.decode_ms_per_token)],
                      tmp / f"rep{i}.log", r"listening on (http://\S+)")
            p.kv, p.replay = ev, rp
            reps.append(p)
            procs.append(p)
        urls = ",".join(r.url for r in reps)

        def kvtier(strategy: str) -> P:
            return spawn([PY, "-m", "router.cli", "--port", "0", "--replicas", urls, "--strategy", strategy,
                          "--block-size", str(args.block_size), "--kv-events", ",".join(r.kv for r in reps),
                          "--kv-replay", ",".join(r.replay for r in reps), "--log-level", "warning"],
                         tmp / f"kvtier-{strategy}.log", r"listening on (http://\S+)")

        def vllm_router(policy: str) -> P:
            exe = shutil.which("vllm-router") or str(Path(PY).parent / "vllm-router")
            port = free_port()
            cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls",
                   *[r.url for r in reps], "--log-level", "warning", "--prometheus-port", str(free_port())]
            if policy == "kv_aware":
                for r in reps:
                    cmd += ["--kv-event-source", f"{r.url}={r.kv}", "--kv-event-replay-source", f"{r.url}={r.replay}"]
                cmd += ["--kv-event-block-size", str(args.block_size), "--kv-event-model", model]
            return spawn(cmd, tmp / f"vllm-router-{policy}.log", None, url=f"http://127.0.0.1:{port}")

        configs: list[tuple[str, Any]] = [
            ("kvtier roundrobin", lambda: kvtier("roundrobin")),
            ("kvtier session", lambda: kvtier("session")),
            ("kvtier prefixaware", lambda: kvtier("prefixaware")),
            ("kvtier kvaware", lambda: kvtier("kvaware")),
        ]
        if not args.skip_vllm_router:
            configs += [("vllm-router round_robin", lambda: vllm_router("round_robin")),
                        ("vllm-router cache_aware", lambda: vllm_router("cache_aware")),
                        ("vllm-router kv_aware", lambda: vllm_router("kv_aware"))]
        if args.only:
            keep = {x.strip() for x in args.only.split(",")}
            configs = [c for c in configs if c[0] in keep]

        rows = []
        prompts = [text(random.Random(i), 60) for i in range(50)]
        set_cost(reps, 0, 0)  # overhead phase: replicas answer at once, so latency is transport + router
        direct_lat = asyncio.run(run_open_loop([r.url for r in reps], args.overhead_requests, args.rate, model,
                                               prompts))
        direct_serial = asyncio.run(run_serial([r.url for r in reps], args.serial_requests, model, prompts))
        set_cost(reps, args.prefill_us_per_token, args.decode_ms_per_token)
        for name, make in configs:
            reset(reps)
            try:
                rt = make()
            except RuntimeError as e:
                print(f"# {name}: could not start ({str(e).splitlines()[0][:200]})")
                continue
            procs.append(rt)
            before = replica_stats(reps)
            res = asyncio.run(run_chat(rt.url, args if not args.skip_chat else argparse.Namespace(
                **{**vars(args), "users": 1, "rounds": 1}), model))
            after = replica_stats(reps)
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
            rt.stop()
            procs.remove(rt)
            hit = res["cached"] / max(1, res["prompt"])
            orc = res["oracle"] / max(1, res["prompt"])
            rows.append({
                "router": name, "reqs": res["n"], "err": res["errors"], "hit": hit, "oracle": orc,
                "hit/oracle": hit / orc if orc else float("nan"),
                "req max/mean": max(served) / statistics.mean(served) if sum(served) else float("nan"),
                "prefill max/mean": max(computed) / statistics.mean(computed) if sum(computed) else float("nan"),
                "lat p50 ms": pct(res["lat"], 0.5) * 1e3, "lat p99 ms": pct(res["lat"], 0.99) * 1e3,
                "wall s": res["wall"], "served": "/".join(map(str, served)),
                "ovh p50 ms": (pct(ol, 0.5) - pct(direct_lat, 0.5)) * 1e3,
                "ovh p99 ms": (pct(ol, 0.99) - pct(direct_lat, 0.99)) * 1e3,
                "via p50 ms": pct(ol, 0.5) * 1e3, "via p99 ms": pct(ol, 0.99) * 1e3, "ol n": len(ol),
                "int p50 ms<=": internal[0], "int p99 ms<=": internal[1],
                "serial +p50 ms": (pct(ser, .5) - pct(direct_serial, .5)) * 1e3,
                "serial +p99 ms": (pct(ser, .99) - pct(direct_serial, .99)) * 1e3,
            })
        print(f"\n# routing bench: {args.users} users x {args.rounds} rounds, {args.systems} shared system prompts "
              f"(~{args.system_words} words), {args.replicas} test replicas, block {args.block_size}, "
              f"prefill {args.prefill_us_per_token} us/token, decode {args.decode_ms_per_token} ms/token")
        print("# overhead: open loop, zero-cost replicas; 'via' = through the router, 'ovh' = via minus the "
              "client round-robining the replicas itself; 'int' = kvtier's own pre-send histogram (bucket bound)")
        print(f"# serial (one at a time, zero-cost replicas) direct: p50 {pct(direct_serial, .5)*1e3:.2f} ms, "
              f"p99 {pct(direct_serial, .99)*1e3:.2f} ms; 'serial +' = added by the router")
        print(f"# direct (client round-robin) at {args.rate:.0f} req/s: p50 {pct(direct_lat, .5)*1e3:.2f} ms, "
              f"p99 {pct(direct_lat, .99)*1e3:.2f} ms (n={len(direct_lat)})")
        cols = ["router", "reqs", "err", "hit", "oracle", "hit/oracle", "req max/mean", "prefill max/mean",
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
    finally:
        for p in procs:
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
