"""`kvtier bench l2 --metadata`: the l2fs master at cluster rates, and what lies past one master.

Why: every KV chunk is one put, so the cluster's L2 write rate is capped by the master's metadata rate, not
by bytes. One run prints, with the load average next to each figure:

1. per namespace size (--files, default 10k and 100k; --million adds 1M), on a 2-worker cluster:
   puts/s of 4 KiB objects from 4 client processes on 2 nodes (`put_many` in batches of --batch), master
   CPU per put (psutil, around the put phase), single-path Stat/s and 64-path PrefixLookup paths/s from
   8 threads, master RSS per file, rebuild time after kill -9 of the master, and the loopback RPC floor of
   the same run: an empty gRPC unary call to a trivial server and the master's cheapest call (Report),
   both from 8 threads;
2. 1 MiB puts (`put_many`, data plane and short-circuit) next to the same bytes as 16 MiB puts over the data
   plane and as a loopback TCP stream;
3. past one master (--shards, default 1,2,4): one cluster of N path-hash sharded masters (`l2fs master
   --shard K/N`) and 2 workers on node-1/node-2 registered with every master, the product `Client` routing
   ("m0;m1" master list: put_many split per shard in parallel, prefix lookups fanned out and recombined),
   and the namespace ops a put costs the master done on a
   Redis server instead (MGET = allocate's existence check, SET NX = publish-if-absent; MGET of 64 =
   a prefix lookup) from the same 4 processes, with redis-server's CPU per put.

With --scoped the per-size clusters run as deployed: a scoped tokens file (l2fs --tokens-file) and every put,
Stat and prefix lookup made with an engine token whose prefix (/bench) covers the paths, so each call pays the
token check, the holder-bound capabilities and the engine's write and read scopes (without it no call is
authenticated and none of those checks runs).

    .venv/bin/kvtier bench l2 --metadata                     # 10k and 100k files, shards 1,2,4, Redis
    .venv/bin/kvtier bench l2 --metadata --quick             # tiny, for tests
    .venv/bin/kvtier bench l2 --metadata --scoped --files 10000 --shards '' --no-redis --mib-objects 0
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from kvtier.bench.common import fmt, table, write_results
from l2fs.client import Client
from l2fs.common import shard_of
from l2fs.testing.cluster import LocalCluster

OBJ = 4096
MIB = 1 << 20
PROCS = 4
THREADS = 8
CHAIN = 64


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _paths(run: str, proc: int, n: int) -> list[str]:
    return [f"/bench/{run}/p{proc}/{i:08d}.data" for i in range(n)]


# --scoped: the tokens file of the per-size clusters (what `kvtier tokens generate` gives an endpoint, with the
# bench's paths as the engine's prefix) and the token the clients use
SCOPED_ENGINE = "bench-engine-token-0123456789abcdef"
SCOPED_ADMIN = "bench-admin-token-0123456789abcdef"
_SCOPED_MASTER, _SCOPED_WORKER = "bench-master-token-0123456789abcdef", "bench-worker-token-0123456789abcdef"


def scoped_security(base: Path) -> dict[str, Any]:
    """LocalCluster options of a cluster with a scoped tokens file (written under `base`): the admin's token for
    the cluster's own calls; the clients use SCOPED_ENGINE (prefix /bench; with read scopes it reads /bench and
    /kvtier/meta, l2fs's default for an entry without read_prefixes, which every l2fs version loads)."""
    base.mkdir(parents=True, exist_ok=True)
    f = base / "tokens.json"
    f.write_text(json.dumps([
        {"name": "master", "token": _SCOPED_MASTER, "role": "worker"},
        {"name": "worker", "token": _SCOPED_WORKER, "role": "worker"},
        {"name": "engine-bench", "token": SCOPED_ENGINE, "role": "engine", "prefixes": ["/bench"]},
        {"name": "ops", "token": SCOPED_ADMIN, "role": "admin"}]))
    return {"token": SCOPED_ADMIN, "master_args": ["--tokens-file", str(f), "--token", _SCOPED_MASTER],
            "worker_args": ["--tokens-file", str(f), "--token", _SCOPED_WORKER]}


def _put_proc(master: str, node: str, run: str, proc: int, n: int, batch: int, size: int, token: str | None,
              ready: Any, start: Any, q: Any) -> None:
    """One client process: put n objects in put_many batches; reports (seconds, published, errors)."""
    client = Client(master, node_id=node, timeout=30.0, token=token)
    data = os.urandom(size)
    paths = _paths(run, proc, n)
    ready.put(proc)
    start.wait()
    t0 = time.perf_counter()
    done = errors = 0
    for i in range(0, n, batch):
        for r in client.put_many([(p, data) for p in paths[i:i + batch]], return_exceptions=True):
            if r is True:
                done += 1
            elif r is not False:
                errors += 1
    q.put((time.perf_counter() - t0, done, errors))
    client.close()


def _redis_proc(port: int, run: str, proc: int, n: int, batch: int, ready: Any, start: Any, q: Any) -> None:
    """The master's namespace ops per put batch, on Redis: MGET (allocate: which paths exist) then a
    pipeline of SET NX path -> 'block,worker,size,crc' (commit: publish-if-absent). Two round trips per batch,
    as AllocateMany + CommitMany."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    paths = _paths(run, proc, n)
    ready.put(proc)
    start.wait()
    t0 = time.perf_counter()
    done = 0
    for i in range(0, n, batch):
        part = paths[i:i + batch]
        exists = r.mget(part)
        pipe = r.pipeline(transaction=False)
        for p, e in zip(part, exists, strict=True):
            if e is None:
                pipe.set(p, f"{os.urandom(16).hex()},w-node-{1 + proc % 2},{OBJ},{zlib.crc32(p.encode())}", nx=True)
        done += sum(1 for ok in pipe.execute() if ok)
    q.put((time.perf_counter() - t0, done, 0))
    r.close()


def _run_procs(target: Callable[..., None], args_for: Callable[[int], tuple[Any, ...]]) -> tuple[float, int, int]:
    """PROCS spawned client processes; the clock starts once all are ready. Returns (wall s, done, errors)."""
    ctx = mp.get_context("spawn")
    ready, start, q = ctx.Queue(), ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=target, args=(*args_for(k), ready, start, q)) for k in range(PROCS)]
    for p in ps:
        p.start()
    for _ in ps:
        ready.get(timeout=120)
    t0 = time.perf_counter()
    start.set()
    res = [q.get(timeout=3600) for _ in ps]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join()
    return wall, sum(r[1] for r in res), sum(r[2] for r in res)


def _rate(clients: Sequence[Any], call: Callable[[Any, int], Any], seconds: float) -> tuple[float, int]:
    """Calls/s of call(client, i) from one thread per client for `seconds`; returns (calls/s, errors)."""
    counts = [0] * len(clients)
    errors = [0] * len(clients)
    stop = time.monotonic() + seconds

    def loop(k: int) -> None:
        i = 0
        while time.monotonic() < stop:
            try:
                call(clients[k], k * 1_000_003 + i)
                counts[k] += 1
            except Exception:  # noqa: BLE001 - counted, the run goes on
                errors[k] += 1
            i += 1

    t0 = time.perf_counter()
    ts = [threading.Thread(target=loop, args=(k,)) for k in range(len(clients))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return round(sum(counts) / (time.perf_counter() - t0), 1), sum(errors)


def _floor_server(q: Any) -> None:
    """A trivial gRPC server: one unary method that returns empty bytes (the cheapest call gRPC serves)."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(THREADS))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "floor.Floor", {"Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"")})])
    q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def grpc_floor(seconds: float) -> float:
    """Empty unary calls/s from THREADS threads (one channel each) to a trivial server in its own process:
    the Python gRPC floor of this box at this moment, which no master call can beat."""
    import grpc

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    srv = ctx.Process(target=_floor_server, args=(q,), daemon=True)
    srv.start()
    try:
        port = q.get(timeout=60)
        chans = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(THREADS)]
        calls = [ch.unary_unary("/floor.Floor/Ping") for ch in chans]
        for c in calls:
            c(b"", timeout=30, wait_for_ready=True)
        rate, _ = _rate(calls, lambda c, i: c(b"", timeout=10), seconds)
        for ch in chans:
            ch.close()
        return rate
    finally:
        srv.kill()
        srv.join()


def _master(cluster: LocalCluster, shard: int = 0) -> psutil.Process:
    proc = cluster.master_procs[shard]
    if proc is None:
        raise RuntimeError("l2fs master not running")
    return psutil.Process(proc.pid)


def _cpu(procs_: Sequence[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs_)


def run_size(cluster: LocalCluster, files: int, batch: int, seconds: float,
             token: str | None = None) -> dict[str, Any]:
    """Fill the namespace with `files` 4 KiB objects and measure every rate at that size; `token`: the clients'
    (--scoped: an engine's), else the cluster's."""
    run = f"n{files}-{os.getpid()}-{int(time.time())}"
    master = _master(cluster)
    rss0, cpu0 = master.memory_info().rss, _cpu([master])
    per = files // PROCS
    scoped, token = token is not None, token or cluster.token
    wall, published, errors = _run_procs(
        _put_proc, lambda k: (cluster.master, f"node-{1 + k % 2}", run, k, per, batch, OBJ, token))
    cpu = _cpu([master]) - cpu0
    out: dict[str, Any] = {
        "files": files, "batch": batch, "scoped": scoped, "put_wall_s": round(wall, 2), "published": published,
        "put_errors": errors, "puts_per_s": round(published / wall, 1),
        "master_cpu_ms_per_put": round(cpu * 1000 / max(1, published), 3),
        "master_rss_bytes_per_file": round((master.memory_info().rss - rss0) / max(1, published), 1),
        "load_put": _load(),
    }
    clients = [cluster.client(timeout=10.0, token=token) for _ in range(THREADS)]
    try:
        everything = [p for k in range(PROCS) for p in _paths(run, k, per)]
        out["empty_grpc_per_s"] = grpc_floor(seconds)
        out["report_rpcs_per_s"], _ = _rate(clients, lambda c, i: c.report(), seconds)
        out["stat_per_s"], out["stat_errors"] = _rate(
            clients, lambda c, i: c.stat(everything[i % len(everything)]) or 1 / 0, seconds)
        chains = [everything[i:i + CHAIN] for i in range(0, len(everything) - CHAIN + 1, CHAIN)]
        calls, _ = _rate(clients, lambda c, i: c.prefix_lookup(chains[i % len(chains)]), seconds)
        out["prefix_paths_per_s"] = round(calls * CHAIN, 1)
        out["load_lookups"] = _load()
        total = clients[0].report().files
        cluster.kill_master(signal.SIGKILL)
        t0 = time.perf_counter()
        cluster.start_master()
        while True:
            try:
                if clients[0].report().files >= total:
                    break
            except Exception:  # noqa: BLE001 - the master is coming back
                pass
            time.sleep(0.05)
        out["rebuild_s"] = round(time.perf_counter() - t0, 2)
        out["files_in_namespace"] = total
        out["load_rebuild"] = _load()
    finally:
        for c in clients:
            c.close()
    return out


BIG = 16 * MIB


def run_mib(cluster: LocalCluster, count: int, batch: int) -> dict[str, Any]:
    """1 MiB objects through put_many (a node without a worker: the data plane; node-1: short-circuit), the
    same bytes as 16 MiB objects over the data plane (its byte limit once metadata is amortized) and a
    loopback TCP stream of the same bytes in 1 MiB messages, in the same run."""
    from kvtier.bench.l2 import tcp_stream_gbps

    out: dict[str, Any] = {"objects": count, "batch": batch}
    arms = (("dataplane", "bench-elsewhere", MIB, batch), ("short_circuit", cluster.workers[0].node_id, MIB, batch),
            ("dataplane_16mib", "bench-elsewhere", BIG, 1))
    for key, node, size, per_call in arms:
        data = os.urandom(size)
        n = max(1, count * MIB // size)
        with cluster.client(node_id=node, timeout=60.0) as c:
            c.put(f"/bench-mib/{key}/warmup", data)
            paths = [f"/bench-mib/{key}/{os.getpid()}-{i}" for i in range(n)]
            t0 = time.perf_counter()
            done = 0
            for i in range(0, n, per_call):
                done += sum(1 for r in c.put_many([(p, data) for p in paths[i:i + per_call]]) if r)
            out[f"put_{key}_gbps"] = round(done * size / (time.perf_counter() - t0) / 1e9, 3)
            for p in paths:
                c.rm(p)
    per = tcp_stream_gbps(MIB, count)
    out["tcp_gbps"] = round(count / sum(1 / g for g in per), 3)  # all the bytes / all the time
    out["dataplane_vs_tcp"] = round(out["put_dataplane_gbps"] / out["tcp_gbps"], 3)
    out["short_circuit_vs_tcp"] = round(out["put_short_circuit_gbps"] / out["tcp_gbps"], 3)
    out["dataplane_vs_16mib"] = round(out["put_dataplane_gbps"] / out["put_dataplane_16mib_gbps"], 3)
    out["load"] = _load()
    return out


def run_shards(base: Path, shards: int, files: int, batch: int, seconds: float) -> dict[str, Any]:
    """One cluster of N path-hash sharded masters and 2 workers (node-1, node-2), product clients routing."""
    with LocalCluster(base / f"s{shards}", workers=2, capacity="8G", heartbeat_timeout=30.0, shards=shards) as cl:
        mprocs = [_master(cl, k) for k in range(shards)]
        run = f"s{shards}-{os.getpid()}-{int(time.time())}"
        per = files // PROCS
        cpu0 = _cpu(mprocs)
        wall, published, errors = _run_procs(
            _put_proc, lambda k: (cl.master, f"node-{1 + k % 2}", run, k, per, batch, OBJ, None))
        cpu = _cpu(mprocs) - cpu0
        load_put = _load()
        clients = [cl.client(timeout=10.0) for _ in range(THREADS)]
        try:
            everything = [p for k in range(PROCS) for p in _paths(run, k, per)]
            chains = [everything[i:i + CHAIN] for i in range(0, len(everything) - CHAIN + 1, CHAIN)]
            calls, lookup_errors = _rate(clients, lambda c, i: c.prefix_lookup(chains[i % len(chains)]) == CHAIN
                                         or 1 / 0, seconds)
        finally:
            for c in clients:
                c.close()
        per_master = [sum(1 for p in everything if shard_of(p, shards) == s) for s in range(shards)]
        return {"arm": "l2fs masters by path hash", "shards": shards, "files": files, "batch": batch,
                "puts_per_s": round(published / wall, 1), "published": published, "put_errors": errors,
                "master_cpu_ms_per_put": round(cpu * 1000 / max(1, published), 3),
                "prefix_paths_per_s": round(calls * CHAIN, 1), "lookup_errors": lookup_errors,
                "files_per_master": per_master, "load_put": load_put, "load_lookups": _load()}


def run_redis(base: Path, files: int, batch: int, seconds: float) -> dict[str, Any]:
    """The master's per-put namespace ops on one redis-server, from the same 4 client processes."""
    import redis

    from kvtier.bench.l2 import RedisArm

    arm = RedisArm(base / "redis")
    arm.setup()
    try:
        assert arm.proc is not None
        port = int(arm.client.connection_pool.connection_kwargs["port"])
        srv = psutil.Process(arm.proc.pid)
        mem0 = int(arm.client.info("memory")["used_memory"])
        run = f"r-{os.getpid()}-{int(time.time())}"
        per = files // PROCS
        cpu0 = _cpu([srv])
        wall, published, errors = _run_procs(_redis_proc, lambda k: (port, run, k, per, batch))
        cpu = _cpu([srv]) - cpu0
        load_put = _load()
        mem = int(arm.client.info("memory")["used_memory"]) - mem0
        everything = [p for k in range(PROCS) for p in _paths(run, k, per)]
        chains = [everything[i:i + CHAIN] for i in range(0, len(everything) - CHAIN + 1, CHAIN)]
        clients = [redis.Redis(host="127.0.0.1", port=port) for _ in range(THREADS)]
        try:
            calls, lookup_errors = _rate(
                clients, lambda c, i: all(v is not None for v in c.mget(chains[i % len(chains)])) or 1 / 0,
                seconds)
        finally:
            for c in clients:
                c.close()
        return {"arm": "redis namespace (MGET + SET NX)", "shards": 1, "files": files, "batch": batch,
                "puts_per_s": round(published / wall, 1), "published": published, "put_errors": errors,
                "master_cpu_ms_per_put": round(cpu * 1000 / max(1, published), 4),
                "prefix_paths_per_s": round(calls * CHAIN, 1), "lookup_errors": lookup_errors,
                "redis_bytes_per_file": round(mem / max(1, published), 1),
                "load_put": load_put, "load_lookups": _load()}
    finally:
        arm.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench l2 --metadata", description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default="10000,100000", help="namespace sizes, comma separated")
    p.add_argument("--million", action="store_true", help="also 1,000,000 files (takes long)")
    p.add_argument("--batch", type=int, default=256, help="put_many batch size (default 256)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per rate measurement")
    p.add_argument("--mib-objects", type=int, default=64, help="1 MiB objects for the byte-rate row (0: skip)")
    p.add_argument("--shards", default="1,2,4", help="master counts for the path-hash prototype ('' skips)")
    p.add_argument("--shard-files", type=int, default=20000, help="files per shard-prototype run")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis namespace prototype")
    p.add_argument("--quick", action="store_true", help="tiny run for tests: 400 files, shards 1,2, 0.5 s rates")
    p.add_argument("--scoped", action="store_true",
                   help="per-size clusters with a scoped tokens file, every client an engine token (prefix "
                        "/bench): the checks a deployed cluster runs on each call")
    p.add_argument("--dir", default=None, help="scratch dir (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write l2_metadata.json/.csv here")
    p.add_argument("--json", default=None, help="also write the per-size rows here (as the old script did)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = [int(s) for s in args.files.split(",") if s] + ([1_000_000] if args.million else [])
        shards = [int(s) for s in args.shards.split(",") if s]
    except ValueError:
        print("kvtier bench l2 --metadata: --files and --shards take comma-separated integers", file=sys.stderr)
        return 2
    if args.quick:
        sizes, shards, args.seconds, args.shard_files, args.mib_objects = [400], [1, 2], 0.5, 400, 8
    if any(n < PROCS for n in sizes) or any(n < 1 for n in shards) or args.batch < 1:
        print(f"kvtier bench l2 --metadata: sizes must be >= {PROCS}, shards and batch >= 1", file=sys.stderr)
        return 2
    rows, past = [], []
    mib: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="l2fs-meta-") as tmp:
        # one cluster per size: RSS per file and rebuild time are then about that size alone
        for i, n in enumerate(sizes):
            sec = scoped_security(Path(tmp) / f"c{n}-tokens") if args.scoped else {}
            with LocalCluster(Path(tmp) / f"c{n}", workers=2, capacity="16G", heartbeat_timeout=30.0, **sec) as cl:
                if i == 0 and args.mib_objects > 0:
                    mib = run_mib(cl, args.mib_objects, 8)
                rows.append(run_size(cl, n, args.batch, args.seconds, SCOPED_ENGINE if args.scoped else None))
            print(json.dumps(rows[-1]), flush=True)
        for n in shards:
            past.append(run_shards(Path(tmp), n, args.shard_files, args.batch, args.seconds))
            print(json.dumps(past[-1]), flush=True)
        if not args.no_redis:
            from shutil import which

            if which("redis-server") is None:
                print("redis-server not found: Redis prototype skipped (Debian package redis-server)")
            else:
                past.append(run_redis(Path(tmp), args.shard_files, args.batch, args.seconds))
                print(json.dumps(past[-1]), flush=True)
    print(report(rows, mib, past))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.out:
        for p in write_results(args.out, "l2_metadata", {"sizes": rows, "mib": mib, "past_one_master": past},
                               rows + past):
            print(f"wrote {p}")
    return 0


def report(rows: list[dict[str, Any]], mib: dict[str, Any] | None, past: list[dict[str, Any]]) -> str:
    """The tables: per namespace size; 1 MiB puts vs TCP; past one master."""
    out = [table(["files", "puts/s (4 procs)", "master CPU ms/put", "Stat/s (8 thr)", "prefix paths/s",
                  "empty gRPC /s", "Report /s", "RSS B/file", "rebuild s", "load put/lookup/rebuild"],
                 [[fmt(r["files"]), fmt(r["puts_per_s"]), fmt(r["master_cpu_ms_per_put"], 3), fmt(r["stat_per_s"]),
                   fmt(r["prefix_paths_per_s"]), fmt(r["empty_grpc_per_s"]), fmt(r["report_rpcs_per_s"]),
                   fmt(r["master_rss_bytes_per_file"]), fmt(r["rebuild_s"], 2),
                   f"{r['load_put']}/{r['load_lookups']}/{r['load_rebuild']}"] for r in rows],
                 title=f"l2fs master, 4 KiB objects, put_many batches of {rows[0]['batch'] if rows else '-'}, "
                       "2 workers (RPC floor: empty gRPC call to a trivial server, and Report, 8 threads)")]
    if mib:
        out.append(table(["1 MiB objects", "put_many data plane GB/s", "put_many short-circuit GB/s",
                          "16 MiB puts data plane GB/s", "loopback TCP GB/s", "data plane / TCP",
                          "short-circuit / TCP", "1 MiB / 16 MiB (data plane)", "load"],
                         [[fmt(mib["objects"]), fmt(mib["put_dataplane_gbps"], 3),
                           fmt(mib["put_short_circuit_gbps"], 3), fmt(mib["put_dataplane_16mib_gbps"], 3),
                           fmt(mib["tcp_gbps"], 3), fmt(mib["dataplane_vs_tcp"], 2),
                           fmt(mib["short_circuit_vs_tcp"], 2), fmt(mib["dataplane_vs_16mib"], 2), fmt(mib["load"])]],
                         title=f"1 MiB puts (put_many, batches of {mib['batch']}) vs the same bytes as 16 MiB puts "
                               "and as a loopback TCP stream (same run)"))
    if past:
        out.append(table(["arm", "masters", "files", "puts/s (4 procs)", "namespace CPU ms/put", "prefix paths/s",
                          "errors", "load put/lookup"],
                         [[r["arm"], fmt(r["shards"]), fmt(r["files"]), fmt(r["puts_per_s"]),
                           fmt(r["master_cpu_ms_per_put"], 4), fmt(r["prefix_paths_per_s"]),
                           fmt(r["put_errors"] + r["lookup_errors"]), f"{r['load_put']}/{r['load_lookups']}"]
                          for r in past],
                         title="Past one master: N path-hash sharded masters (one cluster, workers registered "
                               "with every master) and a Redis namespace "
                               "(namespace CPU = all masters' or redis-server's CPU per put)"))
    return "\n\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
