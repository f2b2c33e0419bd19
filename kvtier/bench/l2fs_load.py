"""Sustained mixed load on an l2fs cluster: many clients doing put / get / prefix-lookup for a while.

Reports, in one run, per-operation throughput and latency (p50 / p99 / max), the error and miss
counts, and the resident memory of the master, every worker and the load generator at the start and
end of the run (memory growth is the leak signal). Starts its own local cluster unless --master is given.

    .venv/bin/kvtier bench load --duration 60 --clients 16
    .venv/bin/kvtier bench load --duration 5 --clients 4 --json out.json

Keys model KV chunks: chains of --chain objects ("/load/c<k>/<i>"). A put (over)writes one chunk with
its order hint (if_absent=False, so every put really writes and replaces a block); a get reads a random
chunk of a random chain; a prefix lookup asks how many leading chunks of a chain exist (one RPC), as
LMCache's batched lookup does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.bench.common import pct, rss_bytes
from l2fs import envs as l2fs_envs

OPS = ("put", "get", "prefix")


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, w = part.partition(":")
        if name not in OPS:
            raise argparse.ArgumentTypeError(f"unknown op {name!r} in --mix (ops: {', '.join(OPS)})")
        mix[name] = float(w)
    if sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError("--mix weights must add up to more than 0")
    return mix


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _client_loop(args: argparse.Namespace, master: str, node: str | None, seed: int, stop: threading.Event,
                 out: dict[str, Any]) -> None:
    """One client: a private l2fs.Client, random ops until stop; latencies in seconds per op."""
    from l2fs.client import Client

    rng = random.Random(seed)
    names, weights = zip(*args.mix.items(), strict=True)
    blob = rng.randbytes(args.size)
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    errors: dict[str, int] = {op: 0 for op in OPS}
    misses = 0
    samples: list[str] = []
    with Client(master, node_id=node, timeout=args.timeout, token=args.token) as c:
        while not stop.is_set():
            op = rng.choices(names, weights)[0]
            chain = rng.randrange(args.chains)
            keys = [f"/load/c{chain:05d}/{i}" for i in range(args.chain)]
            t0 = time.perf_counter()
            try:
                if op == "put":
                    i = rng.randrange(args.chain)
                    c.put(keys[i], blob, if_absent=False, order_hint=i)  # a real write every time
                elif op == "get":
                    if c.get(keys[rng.randrange(args.chain)]) is None:
                        misses += 1
                else:
                    c.prefix_lookup(keys)
            except Exception as e:  # noqa: BLE001 - counted and sampled: the load must report, not die
                errors[op] += 1
                if len(samples) < 5:
                    samples.append(f"{op}: {e!r}")
                continue
            lat[op].append(time.perf_counter() - t0)
    out.update(lat=lat, errors=errors, misses=misses, samples=samples)


def _proc_main(args: argparse.Namespace, master: str, nodes: list[str | None], first: int, n: int,
               deadline: float, q: Any) -> None:
    """A load process: n client threads until the shared wall-clock deadline, results through q."""
    stop = threading.Event()
    outs: list[dict[str, Any]] = [{} for _ in range(n)]
    threads = [threading.Thread(target=_client_loop,
                                args=(args, master, nodes[(first + i) % len(nodes)], first + i, stop, outs[i]))
               for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, deadline - time.time()))
    stop.set()
    for t in threads:
        t.join(args.timeout * args.chain + 30)
    q.put((outs, rss_bytes(os.getpid())))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start (or attach to) a cluster, run the load, return the measured figures."""
    cluster = None
    tmp = None
    pids: dict[str, int] = {}
    if args.master:
        master, nodes = args.master, [None]
    else:
        from l2fs.testing.cluster import LocalCluster

        tmp = tempfile.TemporaryDirectory(prefix="l2fs-load-")
        opts: dict[str, Any] = {"capacity": str(args.capacity)} if args.capacity else {}
        cluster = LocalCluster(Path(tmp.name), workers=args.workers, **opts)
        cluster.__enter__()
        master = cluster.master
        nodes = [w.node_id for w in cluster.workers]
        pids = {f"worker {w.node_id}": w.proc.pid for w in cluster.workers}
        pids["master"] = cluster.master_proc.pid
    try:
        # Warm-up: one full pass of puts so gets and lookups find data, then sample memory.
        from l2fs.client import Client

        with Client(master, timeout=args.timeout, token=args.token) as c:
            blob = os.urandom(args.size)
            for k in range(min(args.chains, args.warm_chains)):
                for i in range(args.chain):
                    c.put(f"/load/c{k:05d}/{i}", blob, order_hint=i)
        rss0 = {name: rss_bytes(pid) for name, pid in pids.items()}
        peak = dict(rss0)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        per = [args.clients // args.procs + (1 if i < args.clients % args.procs else 0) for i in range(args.procs)]
        start = time.time() + 1.0 + 0.5 * args.procs  # spawn time, so every client starts together
        deadline = start + args.duration
        procs, first = [], 0
        for n in per:
            p = ctx.Process(target=_proc_main, args=(args, master, nodes, first, n, deadline, q))
            p.start()
            procs.append(p)
            first += n
        while time.time() < deadline:
            time.sleep(0.5)
            for name, pid in pids.items():
                peak[name] = max(peak[name], rss_bytes(pid))
        results = [q.get(timeout=args.timeout * args.chain + 120) for _ in procs]
        for p in procs:
            p.join(30)
        rss1 = {name: rss_bytes(pid) for name, pid in pids.items()}
    finally:
        if cluster is not None:
            cluster.__exit__(None, None, None)
        if tmp is not None:
            tmp.cleanup()

    lat: dict[str, list[float]] = {op: [] for op in OPS}
    errors = {op: 0 for op in OPS}
    misses, samples, gen_rss = 0, [], []
    for outs, rss in results:
        gen_rss.append(rss)
        for o in outs:
            for op in OPS:
                lat[op] += o["lat"][op]
                errors[op] += o["errors"][op]
            misses += o["misses"]
            samples += o["samples"]
    ops = {}
    for op in OPS:
        v = lat[op]
        ops[op] = {"count": len(v), "ops_per_s": len(v) / args.duration, "p50_ms": pct(v, 50) * 1e3,
                   "p99_ms": pct(v, 99) * 1e3, "max_ms": (max(v) if v else 0.0) * 1e3,
                   "errors": errors[op]}
    mem = {name: {"start_mb": rss0[name] / 2**20, "end_mb": rss1[name] / 2**20, "peak_mb": peak[name] / 2**20,
                  "growth_mb": (rss1[name] - rss0[name]) / 2**20} for name in pids}
    return {"config": {k: v for k, v in vars(args).items() if k not in ("token",)}, "ops": ops,
            "errors": sum(errors.values()), "misses": misses, "error_samples": samples[:5], "memory": mem,
            "generator_rss_mb": [r / 2**20 for r in gen_rss]}


def print_tables(res: dict[str, Any]) -> None:
    cfg = res["config"]
    print(f"\nl2fs mixed load: {cfg['duration']} s, {cfg['clients']} clients in {cfg['procs']} process(es), "
          f"{cfg['size']} B objects, chains of {cfg['chain']}, mix {cfg['mix']}")
    print(f"{'op':<8}{'count':>9}{'ops/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'errors':>8}")
    for op, r in res["ops"].items():
        print(f"{op:<8}{r['count']:>9}{r['ops_per_s']:>10.1f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}"
              f"{r['max_ms']:>10.2f}{r['errors']:>8}")
    print(f"errors total {res['errors']}, get misses {res['misses']}")
    for s in res["error_samples"]:
        print(f"  error sample: {s}")
    if res["memory"]:
        print(f"\n{'process':<16}{'start MiB':>11}{'end MiB':>10}{'peak MiB':>10}{'growth MiB':>12}")
        for name, m in res["memory"].items():
            print(f"{name:<16}{m['start_mb']:>11.1f}{m['end_mb']:>10.1f}{m['peak_mb']:>10.1f}{m['growth_mb']:>12.1f}")
    print(f"load generator RSS MiB: {', '.join(f'{r:.0f}' for r in res['generator_rss_mb'])}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--master", help="attach to a running cluster (default: start a local one)")
    p.add_argument("--token", default=l2fs_envs.get("L2FS_TOKEN"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--capacity", type=_size, default=None, help="per-worker capacity of the local cluster, e.g. 64M")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--procs", type=int, default=2, help="load-generator processes sharing the clients")
    p.add_argument("--size", type=_size, default=64 << 10, help="object size, e.g. 64K, 1M")
    p.add_argument("--chain", type=int, default=8, help="chunks per prefix chain")
    p.add_argument("--chains", type=int, default=64, help="distinct chains")
    p.add_argument("--warm-chains", type=int, default=64, help="chains written before the clock starts")
    p.add_argument("--mix", type=_parse_mix, default=_parse_mix("put:0.2,get:0.5,prefix:0.3"))
    p.add_argument("--timeout", type=float, default=2.0, help="client deadline per call")
    p.add_argument("--json", help="also write the figures as JSON here")
    p.add_argument("--max-growth-mb", type=float, default=64.0,
                   help="exit 1 if a server process grew more than this (MiB) during the run, or on any error")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 1 or args.procs < 1 or args.duration <= 0:
        print("l2fs_load: --clients, --procs and --duration must be positive", file=sys.stderr)
        return 2
    args.procs = min(args.procs, args.clients)
    res = run(args)
    print_tables(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    grown = {n: m["growth_mb"] for n, m in res["memory"].items() if m["growth_mb"] > args.max_growth_mb}
    if res["errors"] or grown:
        print(f"FAIL: {res['errors']} errors; grew beyond {args.max_growth_mb} MiB: {grown or 'none'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
