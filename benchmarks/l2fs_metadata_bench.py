"""The l2fs master at cluster rates: how many small puts, stats and prefix lookups one master process serves.

Why: every KV chunk is one put, so the cluster's L2 write rate is capped by the master's metadata rate, not
by bytes. One run prints, per namespace size (--files, default 10k and 100k; --million adds 1M):

- puts/s of 4 KiB objects from 4 client processes on 2 nodes (2 per node, `put_many` in batches of --batch)
- master CPU per put (psutil cpu_times of the master process before/after the put phase)
- single-path Stat/s from 8 client threads (one Client each)
- prefix-lookup paths/s (64-path PrefixLookup calls from 8 threads)
- master RSS per file (RSS growth over the put phase / files)
- rebuild time after kill -9 of the master (restart until Report shows every file again)
- the loopback gRPC floor of the same run: Report RPCs/s from 8 threads (an almost empty unary call)

    .venv/bin/python benchmarks/l2fs_metadata_bench.py                 # 10k and 100k files
    .venv/bin/python benchmarks/l2fs_metadata_bench.py --files 10000 --json out.json
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
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l2fs.client import Client  # noqa: E402
from l2fs.local import LocalCluster  # noqa: E402

OBJ = 4096
PROCS = 4
THREADS = 8


def _paths(run: str, proc: int, n: int) -> list[str]:
    return [f"/bench/{run}/p{proc}/{i:08d}.data" for i in range(n)]


def _put_proc(master: str, node: str, run: str, proc: int, n: int, batch: int, start: Any, q: Any) -> None:
    """One client process: put n objects in put_many batches; reports (seconds, published, errors)."""
    c = Client(master, node_id=node, timeout=30.0)
    data = os.urandom(OBJ)
    paths = _paths(run, proc, n)
    start.wait()
    t0 = time.perf_counter()
    done = errors = 0
    for i in range(0, n, batch):
        items = [(p, data) for p in paths[i:i + batch]]
        try:
            done += sum(c.put_many(items))
        except Exception:  # noqa: BLE001 - counted, the run goes on
            errors += 1
    q.put((time.perf_counter() - t0, done, errors))
    c.close()


def _rate(clients: list[Client], call: Any, seconds: float) -> tuple[float, int]:
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
            except Exception:  # noqa: BLE001
                errors[k] += 1
            i += 1

    t0 = time.perf_counter()
    ts = [threading.Thread(target=loop, args=(k,)) for k in range(len(clients))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - t0), sum(errors)


def run_size(cluster: LocalCluster, files: int, batch: int, seconds: float) -> dict[str, Any]:
    """Fill the namespace with `files` 4 KiB objects and measure every rate at that size."""
    run = f"n{files}-{os.getpid()}-{int(time.time())}"
    master = psutil.Process(cluster.master_proc.pid)
    rss0 = master.memory_info().rss
    cpu0 = sum(master.cpu_times()[:2])
    ctx = mp.get_context("spawn")
    start, q = ctx.Event(), ctx.Queue()
    per = files // PROCS
    ps = [ctx.Process(target=_put_proc, args=(cluster.master, f"node-{1 + k % 2}", run, k, per, batch, start, q))
          for k in range(PROCS)]
    for p in ps:
        p.start()
    time.sleep(3.0)  # let the spawned interpreters import before the clock starts
    t0 = time.perf_counter()
    start.set()
    res = [q.get() for _ in ps]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join()
    cpu = sum(master.cpu_times()[:2]) - cpu0
    published = sum(r[1] for r in res)
    out: dict[str, Any] = {
        "files": files, "batch": batch, "put_wall_s": round(wall, 2), "published": published,
        "put_errors": sum(r[2] for r in res), "puts_per_s": round(published / wall, 1),
        "master_cpu_ms_per_put": round(cpu * 1000 / max(1, published), 3),
        "master_rss_bytes_per_file": round((master.memory_info().rss - rss0) / max(1, published), 1),
    }
    clients = [cluster.client(timeout=10.0) for _ in range(THREADS)]
    try:
        everything = [p for k in range(PROCS) for p in _paths(run, k, per)]
        out["report_rpcs_per_s"], _ = _rate(clients, lambda c, i: c.report(), seconds)
        out["stat_per_s"], out["stat_errors"] = _rate(
            clients, lambda c, i: c.stat(everything[i % len(everything)]) or 1 / 0, seconds)
        chains = [everything[i:i + 64] for i in range(0, len(everything) - 63, 64)]
        calls, _ = _rate(clients, lambda c, i: c.prefix_lookup(chains[i % len(chains)]), seconds)
        out["prefix_paths_per_s"] = round(calls * 64, 1)
        for key in ("report_rpcs_per_s", "stat_per_s"):
            out[key] = round(out[key], 1)
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
    finally:
        for c in clients:
            c.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", default="10000,100000", help="namespace sizes, comma separated")
    ap.add_argument("--million", action="store_true", help="also 1,000,000 files (takes long)")
    ap.add_argument("--batch", type=int, default=256, help="put_many batch size (default 256)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per rate measurement")
    ap.add_argument("--dir", default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.files.split(",") if s] + ([1_000_000] if args.million else [])
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="l2fs-meta-") as tmp:
        # one cluster per size: RSS per file and rebuild time are then about that size alone
        for n in sizes:
            with LocalCluster(Path(tmp) / f"c{n}", workers=2, capacity="16G", heartbeat_timeout=30.0) as cl:
                row = run_size(cl, n, args.batch, args.seconds)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
