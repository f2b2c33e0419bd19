"""Same-node puts, by block size: a sealed memfd the worker adopts (ReserveLocal/AdoptLocal) against the
worker's TCP data plane on loopback, next to a plain write of the same bytes into files on the same disk.

    .venv/bin/kvtier bench local-put [--sizes 64K,1M,4M,8M] [--blocks 64] [--reps 5]

Why: a same-node put can go either way. Since write capabilities carry the allocated size, the worker copies
each memfd into its store at adoption (a writer cannot grow a sealed file it was given), and this measured at
which sizes that path was still worth having: at none (2026-12-04), so the client now writes same-node blocks
over the data plane unless told otherwise (l2fs.client.Client's local_writes). Each rep writes one batch of
--blocks fresh paths with put_many (as LMCache's batched put does) per arm; arms alternate within a rep, and
their order turns each rep, so load on a shared box hits both alike. Every arm reads one block back and compares it, and the worker's own counter of fds
passed for writes says which path a batch really took.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.bench.common import table, write_results
from l2fs.common import parse_size

ARMS = ("memfd", "data plane")
_FD_WRITES = re.compile(r'^l2fs_worker_fdpass_fds_total\{op="write"\} ([0-9.e+]+)$', re.M)


def _sizes(text: str) -> list[int]:
    try:
        out = [parse_size(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError("--sizes needs positive sizes, e.g. 64K,1M")
    return out


def _fd_writes(metrics_port: int | None) -> float:
    """The worker's count of fds passed for writes (its own /metrics)."""
    if metrics_port is None:
        return float("nan")
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        m = _FD_WRITES.search(r.read().decode())
    return float(m.group(1)) if m else 0.0


def _file_batch(d: Path, blobs: list[bytes]) -> None:
    """The floor: the same bytes written into fresh files in a directory on the worker's disk (page cache)."""
    for i, b in enumerate(blobs):
        fd = os.open(d / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            mv = memoryview(b)
            n = 0
            while n < len(mv):
                n += os.write(fd, mv[n:])
        finally:
            os.close(fd)


def run(args: argparse.Namespace, scratch: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from l2fs.testing.cluster import LocalCluster

    raw: list[dict[str, Any]] = []
    cap = max(args.sizes) * args.blocks * 4 + (256 << 20)
    # a short socket path of our own: the default sits next to the data dir, and a deep scratch dir would make it
    # longer than a Unix socket's 108 bytes (the worker then passes no fds and the client falls back to files)
    with (tempfile.TemporaryDirectory(prefix="kvt-lp-", dir="/tmp") as sock_dir,
          LocalCluster(scratch / "l2fs", workers=1, capacity=str(cap),
                       worker_args=["--domain-socket", f"{sock_dir}/w.sock"]) as cluster):
        worker = cluster.workers[0]
        clients = {"memfd": cluster.client(worker.node_id, timeout=args.timeout, local_writes=True),
                   "data plane": cluster.client(worker.node_id, timeout=args.timeout, local_writes=False)}
        files = scratch / "files"
        try:
            for size in args.sizes:
                blobs = [os.urandom(size) for _ in range(args.blocks)]
                for rep in range(args.reps + 1):  # rep 0 warms up both paths and is not counted
                    order = list(ARMS) if rep % 2 else list(reversed(ARMS))
                    for arm in order:
                        paths = [f"/bench/local-put/{size}/{rep}/{arm.replace(' ', '-')}/{i}"
                                 for i in range(args.blocks)]
                        before = _fd_writes(worker.metrics_port)
                        t0 = time.perf_counter()
                        res = clients[arm].put_many(list(zip(paths, blobs, strict=True)))
                        dt = time.perf_counter() - t0
                        fds = _fd_writes(worker.metrics_port) - before
                        ok = sum(1 for r in res if r is True)
                        back = clients[arm].get(paths[-1])
                        if rep:
                            raw.append({"size": size, "blocks": args.blocks, "rep": rep, "arm": arm, "s": dt,
                                        "gbps": size * args.blocks / dt / 1e9, "published": ok,
                                        "fd_writes": fds, "read_back_equal": back == blobs[-1]})
                        for p in paths:  # keep the worker's store from evicting the next batch's blocks
                            clients[arm].rm(p)
                    files.mkdir(parents=True, exist_ok=True)
                    t0 = time.perf_counter()
                    _file_batch(files, blobs)
                    dt = time.perf_counter() - t0
                    if rep:
                        raw.append({"size": size, "blocks": args.blocks, "rep": rep, "arm": "local file", "s": dt,
                                    "gbps": size * args.blocks / dt / 1e9, "published": args.blocks,
                                    "fd_writes": 0.0, "read_back_equal": True})
                print(f"[local-put] {size} B x {args.blocks}: done", file=sys.stderr, flush=True)
        finally:
            for c in clients.values():
                c.close()
    return summarize(args, raw), raw


def summarize(args: argparse.Namespace, raw: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for size in args.sizes:
        med = {arm: statistics.median(r["s"] for r in raw if r["size"] == size and r["arm"] == arm)
               for arm in (*ARMS, "local file")}
        mine = [r for r in raw if r["size"] == size]
        rows.append({
            "size": size, "blocks": args.blocks,
            **{f"{arm}_s_p50": med[arm] for arm in med},
            **{f"{arm}_gbps_p50": size * args.blocks / med[arm] / 1e9 for arm in med},
            "memfd_vs_data_plane": med["data plane"] / med["memfd"],
            "memfd_vs_file": med["local file"] / med["memfd"],
            "data_plane_vs_file": med["local file"] / med["data plane"],
            "memfd_fd_writes": sum(r["fd_writes"] for r in mine if r["arm"] == "memfd"),
            "data_plane_fd_writes": sum(r["fd_writes"] for r in mine if r["arm"] == "data plane"),
            "all_published": all(r["published"] == r["blocks"] for r in mine),
            "all_read_back_equal": all(r["read_back_equal"] for r in mine),
        })
    return {"reps": args.reps, "blocks": args.blocks, "rows": rows}


def print_table(summary: dict[str, Any]) -> None:
    print(table(["block", "memfd ms", "data plane ms", "file ms", "memfd GB/s", "data plane GB/s", "file GB/s",
                 "memfd speed / data plane", "memfd / file", "data plane / file"],
                [[f"{r['size'] / 1024:.0f} KiB", f"{r['memfd_s_p50'] * 1e3:.1f}", f"{r['data plane_s_p50'] * 1e3:.1f}",
                  f"{r['local file_s_p50'] * 1e3:.1f}", f"{r['memfd_gbps_p50']:.2f}", f"{r['data plane_gbps_p50']:.2f}",
                  f"{r['local file_gbps_p50']:.2f}",
                  f"{r['memfd_vs_data_plane']:.2f}x", f"{r['memfd_vs_file']:.2f}x",
                  f"{r['data_plane_vs_file']:.2f}x"] for r in summary["rows"]],
                title=f"same-node put_many of {summary['blocks']} blocks, p50 of {summary['reps']} reps "
                      "(ratios: speed against the right-hand arm; > 1 = faster)"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench local-put", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_sizes, default=_sizes("64K,1M,4M,8M"), help="block sizes (default 64K,1M,4M,8M)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per put_many batch (default 64)")
    p.add_argument("--reps", type=int, default=5, help="batches per size and arm, after one warm-up (default 5)")
    p.add_argument("--timeout", type=float, default=30.0, help="client deadline per call")
    p.add_argument("--quick", action="store_true", help="tiny run for CI: 64 KiB and 1 MiB, 8 blocks, 1 rep")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where JSON/CSV go")
    p.add_argument("--dir", type=Path, default=None, help="scratch dir (default: a temp dir on local disk)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sizes, args.blocks, args.reps = [64 << 10, 1 << 20], 8, 1
    if args.blocks < 1 or args.reps < 1:
        print("kvtier bench local-put: --blocks and --reps must be at least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-local-put-", dir=args.dir or "/var/tmp") as d:
        summary, raw = run(args, Path(d))
    print_table(summary)
    for path in write_results(args.out, "local_put", summary, raw):
        print(f"wrote {path}")
    bad = [r["size"] for r in summary["rows"] if not (r["all_published"] and r["all_read_back_equal"])]
    if bad:
        print(f"FAIL: blocks not published or read back wrong at sizes {bad}", file=sys.stderr)
        return 1
    astray = [r["size"] for r in summary["rows"]
              if r["memfd_fd_writes"] < r["blocks"] * args.reps or r["data_plane_fd_writes"]]
    if astray:
        print(f"FAIL: an arm did not take its path at sizes {astray} (the worker's fd count for writes)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
