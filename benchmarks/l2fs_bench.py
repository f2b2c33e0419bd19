"""l2fs throughput benchmark: prints one table of raw numbers and ratios measured side by side in one run.

    .venv/bin/python benchmarks/l2fs_bench.py [--iters 20] [--size 14680064] [--dir /tmp/l2fs-bench]

Object size defaults to one 256-token KV chunk of a 7B model (Qwen2-7B: 57,344 B/token -> 14.7 MB).
Rows:
  same-node read   short-circuit get() vs a plain read of the same bytes from a local file (goal >= 0.8x)
  cross-node read  get() with short-circuit off, over the TCP data plane and over gRPC streaming,
                   vs a raw loopback TCP stream of the same bytes
  write            put() same node (short-circuit) and remote (TCP data plane, gRPC) vs a plain file write
  metadata         batch stat_many / prefix_lookup (64 paths per call) and single stat
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l2fs.local import LocalCluster

CHUNK = 256 * 57344  # 14,680,064 bytes


def timeit(fn: Callable[[int], object], iters: int, warmup: int = 2) -> list[float]:
    """Per-call wall times (s) after a short warm-up."""
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def paired(fa: Callable[[int], object], fb: Callable[[int], object], iters: int,
           warmup: int = 2) -> tuple[list[float], list[float]]:
    """Interleave A and B call by call, so load changes on a shared box hit both sides alike."""
    for i in range(warmup):
        fa(i)
        fb(i)
    ta, tb = [], []
    for i in range(iters):
        t0 = time.perf_counter()
        fa(i)
        t1 = time.perf_counter()
        fb(i)
        ta.append(t1 - t0)
        tb.append(time.perf_counter() - t1)
    return ta, tb


def gbps(size: int, times: list[float]) -> float:
    return size / statistics.median(times) / 1e9


def tcp_reader(data: bytes) -> Callable[[int], None]:
    """Loopback TCP: a server thread sendall()s the object per request; the client recv_into()s it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    cli = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(len(data))
    mv = memoryview(buf)

    def one(_: int) -> None:
        cli.sendall(b"g")
        n = 0
        while n < len(data):
            n += cli.recv_into(mv[n:])

    return one


def measure(args: argparse.Namespace, base: Path, data: bytes) -> dict[str, list[float]]:
    """Per-call times of every case on a 2-worker local cluster (writes, same-node and cross-node reads,
    metadata), each paired with its plain-file or raw-TCP reference where it has one."""
    size, iters = len(data), args.iters
    t: dict[str, list[float]] = {}
    with LocalCluster(base / "cluster", workers=2, capacity=str(max(4 * size * (iters + 4), 1 << 30))) as cl:
        n1 = cl.workers[0].node_id
        local = cl.client(node_id=n1, timeout=30)
        remote = cl.client(node_id="bench-remote", short_circuit=False, data_plane=True, timeout=30)
        rgrpc = cl.client(node_id="bench-remote", short_circuit=False, data_plane=False, timeout=30)

        # --- writes ---
        plain_file = base / "plain.bin"

        def plain_write(i: int) -> None:  # a new file each time, like put()
            with open(base / f"plain-w{i}-{time.monotonic_ns()}.bin", "wb", buffering=0) as f:
                f.write(data)

        t["plain_w"], t["sc_w"] = paired(plain_write, lambda i: local.put(f"/bench/sc-w/{i}", data), iters)
        t["tcp_w"] = timeit(lambda i: remote.put(f"/bench/tcp-w/{i}", data), iters)
        t["grpc_w"] = timeit(lambda i: rgrpc.put(f"/bench/grpc-w/{i}", data), iters)

        # --- same-node read ---
        plain_file.write_bytes(data)
        local.put("/bench/obj", data)
        assert local.stat("/bench/obj").nodes == [n1], "object not on the local node"

        def plain_read(_: int) -> None:
            with open(plain_file, "rb", buffering=0) as f:
                f.read(size + 1)

        assert local.get("/bench/obj") == data
        t["plain_r"], t["sc_r"] = paired(plain_read, lambda _: local.get("/bench/obj"), iters)
        buf = bytearray(size)
        pbuf = bytearray(size)

        def plain_readinto(_: int) -> None:
            with open(plain_file, "rb", buffering=0) as f:
                f.readinto(pbuf)

        t["plain_into"], t["sc_into"] = paired(plain_readinto, lambda _: local.get_into("/bench/obj", buf), iters)

        # --- cross-node read ---
        assert remote.get("/bench/obj") == data and rgrpc.get("/bench/obj") == data
        tcp_one = tcp_reader(data)
        t["tcp"], t["dp_r"] = paired(tcp_one, lambda _: remote.get("/bench/obj"), iters)
        t["tcp2"], t["dp_into"] = paired(tcp_one, lambda _: remote.get_into("/bench/obj", buf), iters)
        t["grpc_r"] = timeit(lambda _: rgrpc.get("/bench/obj"), iters)
        t["grpc_into"] = timeit(lambda _: rgrpc.get_into("/bench/obj", buf), iters)

        # --- metadata ---
        paths = [f"/bench/meta/{i}" for i in range(args.batch)]
        local.put_many([(q, b"m") for q in paths])
        m_iters = max(50, iters * 10)
        t["stat_many"] = timeit(lambda _: local.stat_many(paths), m_iters)
        t["prefix"] = timeit(lambda _: local.prefix_lookup(paths), m_iters)
        t["stat"] = timeit(lambda _: local.stat(paths[0]), m_iters)
        local.close()
        remote.close()
        rgrpc.close()
    return t


def result_rows(t: dict[str, list[float]], size: int, batch: int) -> list[tuple[str, str, str, str]]:
    """(case, throughput, median, ratio to its reference) per case."""
    plain_r, sc_r, sc_into = gbps(size, t['plain_r']), gbps(size, t['sc_r']), gbps(size, t['sc_into'])
    grpc_r, grpc_into, tcp = gbps(size, t['grpc_r']), gbps(size, t['grpc_into']), gbps(size, t['tcp'])
    dp_r, dp_into = gbps(size, t['dp_r']), gbps(size, t['dp_into'])
    plain_into, tcp2 = gbps(size, t['plain_into']), gbps(size, t['tcp2'])
    plain_w, sc_w, grpc_w = gbps(size, t['plain_w']), gbps(size, t['sc_w']), gbps(size, t['grpc_w'])
    tcp_w = gbps(size, t['tcp_w'])
    return [
        ("plain local file read", f"{plain_r:.2f} GB/s", f"{statistics.median(t['plain_r']) * 1e3:.2f} ms", "1.00x"),
        ("same-node get (short-circuit)", f"{sc_r:.2f} GB/s", f"{statistics.median(t['sc_r']) * 1e3:.2f} ms",
         f"{sc_r / plain_r:.2f}x of plain"),
        ("plain local file readinto", f"{plain_into:.2f} GB/s", f"{statistics.median(t['plain_into']) * 1e3:.2f} ms",
         "1.00x"),
        ("same-node get_into (short-circuit)", f"{sc_into:.2f} GB/s",
         f"{statistics.median(t['sc_into']) * 1e3:.2f} ms", f"{sc_into / plain_into:.2f}x of plain readinto"),
        ("raw loopback TCP stream", f"{tcp:.2f} GB/s", f"{statistics.median(t['tcp']) * 1e3:.2f} ms", "1.00x"),
        ("cross-node get (TCP data plane)", f"{dp_r:.2f} GB/s", f"{statistics.median(t['dp_r']) * 1e3:.2f} ms",
         f"{dp_r / tcp:.2f}x of TCP; {dp_r / 1.84:.2f}x of 1.84 GB/s"),
        ("raw loopback TCP stream (2nd pairing)", f"{tcp2:.2f} GB/s", f"{statistics.median(t['tcp2']) * 1e3:.2f} ms",
         "1.00x"),
        ("cross-node get_into (TCP data plane)", f"{dp_into:.2f} GB/s",
         f"{statistics.median(t['dp_into']) * 1e3:.2f} ms", f"{dp_into / tcp2:.2f}x of TCP (2nd); "
         f"{dp_into / 1.84:.2f}x of 1.84 GB/s"),
        ("cross-node get (gRPC stream)", f"{grpc_r:.2f} GB/s", f"{statistics.median(t['grpc_r']) * 1e3:.2f} ms",
         f"{grpc_r / tcp:.2f}x of TCP; {grpc_r / 1.84:.2f}x of 1.84 GB/s"),
        ("cross-node get_into (gRPC stream)", f"{grpc_into:.2f} GB/s", f"{statistics.median(t['grpc_into']) * 1e3:.2f} ms",
         f"{grpc_into / tcp:.2f}x of TCP"),
        ("plain local file write", f"{plain_w:.2f} GB/s", f"{statistics.median(t['plain_w']) * 1e3:.2f} ms", "1.00x"),
        ("same-node put (short-circuit)", f"{sc_w:.2f} GB/s", f"{statistics.median(t['sc_w']) * 1e3:.2f} ms",
         f"{sc_w / plain_w:.2f}x of plain"),
        ("remote put (TCP data plane)", f"{tcp_w:.2f} GB/s", f"{statistics.median(t['tcp_w']) * 1e3:.2f} ms",
         f"{tcp_w / plain_w:.2f}x of plain"),
        ("remote put (gRPC stream)", f"{grpc_w:.2f} GB/s", f"{statistics.median(t['grpc_w']) * 1e3:.2f} ms",
         f"{grpc_w / plain_w:.2f}x of plain"),
        (f"stat_many ({batch} paths/call)", f"{batch / statistics.median(t['stat_many']):,.0f} paths/s",
         f"{statistics.median(t['stat_many']) * 1e3:.3f} ms", f"{1 / statistics.median(t['stat_many']):,.0f} calls/s"),
        (f"prefix_lookup ({batch} paths/call)", f"{batch / statistics.median(t['prefix']):,.0f} paths/s",
         f"{statistics.median(t['prefix']) * 1e3:.3f} ms", f"{1 / statistics.median(t['prefix']):,.0f} calls/s"),
        ("stat (1 path/call)", f"{1 / statistics.median(t['stat']):,.0f} ops/s",
         f"{statistics.median(t['stat']) * 1e3:.3f} ms", ""),
    ]


def print_table(rows: list[tuple[str, str, str, str]], size: int, iters: int) -> None:
    mb = size / 1e6
    print(f"\nl2fs benchmark: object {size:,} B ({mb:.1f} MB), {iters} iterations (median), "
          f"{os.cpu_count()} CPUs, loopback, page-cache-warm files")
    w = [max(len(r[i]) for r in rows + [("case", "throughput", "median", "ratio")]) for i in range(4)]
    hdr = ("case", "throughput", "median", "ratio")
    print(" | ".join(h.ljust(w[i]) for i, h in enumerate(hdr)))
    print("-+-".join("-" * x for x in w))
    for r in rows:
        print(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)))



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--size", type=int, default=CHUNK)
    p.add_argument("--dir", default=None, help="scratch dir (default: a temp dir)")
    p.add_argument("--batch", type=int, default=64, help="paths per stat_many/prefix_lookup call")
    args = p.parse_args(argv)
    base = Path(args.dir or tempfile.mkdtemp(prefix="l2fs-bench-"))
    t = measure(args, base, os.urandom(args.size))
    print_table(result_rows(t, args.size, args.batch), args.size, args.iters)
    return 0

if __name__ == "__main__":
    sys.exit(main())
