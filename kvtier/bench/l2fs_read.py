"""l2fs throughput benchmark: prints one table of raw numbers and ratios measured side by side in one run.

    .venv/bin/kvtier bench l2fs [--iters 20] [--size 14680064] [--dir /tmp/l2fs-bench]

Object size defaults to one 256-token KV chunk of a 7B model (Qwen2-7B: 57,344 B/token -> 14.7 MB).
Rows:
  same-node read   short-circuit get() vs a plain read of the same bytes from a local file (goal >= 0.8x)
  cross-node read  get() with short-circuit off, over the TCP data plane and over gRPC streaming,
                   vs a raw loopback TCP stream of the same bytes
  write            put() same node (data plane, the default) and remote (TCP data plane, gRPC) vs a plain file write
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

from l2fs.testing.cluster import LocalCluster

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
    g = {k: gbps(size, v) for k, v in t.items()}
    med = {k: statistics.median(v) for k, v in t.items()}

    def io(case: str, k: str, ratio: str) -> tuple[str, str, str, str]:
        return case, f"{g[k]:.2f} GB/s", f"{med[k] * 1e3:.2f} ms", ratio

    def of(k: str, ref: str, what: str) -> str:
        return f"{g[k] / g[ref]:.2f}x of {what}"

    def net(k: str) -> str:  # against the 1.84 GB/s goal
        return f"{g[k] / 1.84:.2f}x of 1.84 GB/s"

    rows = [
        io("plain local file read", "plain_r", "1.00x"),
        io("same-node get (short-circuit)", "sc_r", of("sc_r", "plain_r", "plain")),
        io("plain local file readinto", "plain_into", "1.00x"),
        io("same-node get_into (short-circuit)", "sc_into", of("sc_into", "plain_into", "plain readinto")),
        io("raw loopback TCP stream", "tcp", "1.00x"),
        io("cross-node get (TCP data plane)", "dp_r", f"{of('dp_r', 'tcp', 'TCP')}; {net('dp_r')}"),
        io("raw loopback TCP stream (2nd pairing)", "tcp2", "1.00x"),
        io("cross-node get_into (TCP data plane)", "dp_into", f"{of('dp_into', 'tcp2', 'TCP (2nd)')}; {net('dp_into')}"),
        io("cross-node get (gRPC stream)", "grpc_r", f"{of('grpc_r', 'tcp', 'TCP')}; {net('grpc_r')}"),
        io("cross-node get_into (gRPC stream)", "grpc_into", of("grpc_into", "tcp", "TCP")),
        io("plain local file write", "plain_w", "1.00x"),
        io("same-node put (data plane: the default)", "sc_w", of("sc_w", "plain_w", "plain")),
        io("remote put (TCP data plane)", "tcp_w", of("tcp_w", "plain_w", "plain")),
        io("remote put (gRPC stream)", "grpc_w", of("grpc_w", "plain_w", "plain")),
    ]
    for case, k in ((f"stat_many ({batch} paths/call)", "stat_many"), (f"prefix_lookup ({batch} paths/call)", "prefix")):
        rows.append((case, f"{batch / med[k]:,.0f} paths/s", f"{med[k] * 1e3:.3f} ms", f"{1 / med[k]:,.0f} calls/s"))
    rows.append(("stat (1 path/call)", f"{1 / med['stat']:,.0f} ops/s", f"{med['stat'] * 1e3:.3f} ms", ""))
    return rows


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
    p = argparse.ArgumentParser(prog="kvtier bench l2fs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--size", type=int, default=CHUNK)
    p.add_argument("--dir", default=None, help="where its scratch dir goes (default: the temp dir); removed after")
    p.add_argument("--batch", type=int, default=64, help="paths per stat_many/prefix_lookup call")
    args = p.parse_args(argv)
    # a scratch dir of its own, removed afterwards (it holds the cluster's blocks: ~1.2 GB a run at the defaults;
    # before, every run left it behind in /tmp)
    with tempfile.TemporaryDirectory(prefix="l2fs-bench-", dir=args.dir) as d:
        t = measure(args, Path(d), os.urandom(args.size))
    print_table(result_rows(t, args.size, args.batch), args.size, args.iters)
    return 0

if __name__ == "__main__":
    sys.exit(main())
