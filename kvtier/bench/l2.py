"""`kvtier bench l2`: the L2 data path side by side, one run, the same bytes.

Arms: a plain local directory (LMCache's stock fs:// target and the physical limit on this machine), the l2fs
native client on the same node (short-circuit) and across nodes (gRPC from the other node's worker), the l2fs
FUSE mount, and Redis (HyperPod's other L2 backend; Debian's redis-server started here on a free loopback
port). A raw loopback TCP stream is printed as the network limit. Ratios are to the local directory.
Objects: 14.7 MiB (one 256-token chunk of a 7B model: 256 x 56 KiB) and 32 MiB by default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.bench.common import fmt, pct, table, write_results
from kvtier.up import log
from l2fs import procs
from l2fs.common import free_port

MIB = 1 << 20
DEFAULT_SIZES = [int(14.7 * MIB), 32 * MIB]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


class Arm:
    """One storage target: write(key, data) and read(key, buf) -> bytes read (or None on a miss)."""

    name = "?"

    def setup(self) -> None: ...

    def write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def read(self, key: str, buf: bytearray) -> int | None:
        raise NotImplementedError

    def cleanup(self, keys: list[str]) -> None: ...

    def close(self) -> None: ...


class LocalDir(Arm):
    name = "local dir"

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def write(self, key: str, data: bytes) -> None:
        with open(self.root / key, "wb") as f:
            f.write(data)

    def read(self, key: str, buf: bytearray) -> int | None:
        with open(self.root / key, "rb", buffering=0) as f:
            n = 0
            view = memoryview(buf)
            while True:
                got = f.readinto(view[n:])
                if not got:
                    return n
                n += got

    def cleanup(self, keys: list[str]) -> None:
        for k in keys:
            (self.root / k).unlink(missing_ok=True)


class L2fsArm(Arm):
    """Writes through writer (a node-1 client), reads through reader (same node or the other node)."""

    def __init__(self, name: str, writer: Any, reader: Any, prefix: str, expect_node: str) -> None:
        self.name = name
        self.writer, self.reader, self.prefix, self.expect_node = writer, reader, prefix, expect_node
        self.placement: list[list[str]] = []

    def write(self, key: str, data: bytes) -> None:
        if not self.writer.put(f"{self.prefix}/{key}", data, if_absent=False):
            raise RuntimeError(f"l2fs put of {key} did not publish")

    def read(self, key: str, buf: bytearray) -> int | None:
        return self.reader.get_into(f"{self.prefix}/{key}", memoryview(buf))

    def check_placement(self, key: str) -> None:
        info = self.writer.stat(f"{self.prefix}/{key}")
        self.placement.append(list(info.nodes) if info else [])

    def cleanup(self, keys: list[str]) -> None:
        for k in keys:
            try:
                self.writer.rm(f"{self.prefix}/{k}")
            except Exception:  # noqa: BLE001 - any failure here is reported, never fatal
                pass


class MountArm(LocalDir):
    """The l2fs FUSE mount is just a directory to the benchmark (that is the point)."""

    name = "l2fs mount"

    def __init__(self, mountpoint: Path, master: str, node_id: str, log_path: Path) -> None:
        self.mountpoint = mountpoint
        self.master, self.node_id, self.log_path = master, node_id, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.root = mountpoint / "bench-l2"

    def setup(self) -> None:
        cmd = [sys.executable, "-m", "l2fs.cli", "mount", str(self.mountpoint), "--master", self.master,
               "--node-id", self.node_id]
        self.proc = procs.spawn(cmd, self.log_path)
        procs.wait_ready(self.proc, lambda: os.path.ismount(self.mountpoint), timeout=30, what="l2fs mount",
                         log_path=self.log_path, interval=0.2)
        self.root.mkdir(exist_ok=True)

    def close(self) -> None:
        if self.proc is None:
            return
        subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
        procs.stop(self.proc, grace=10)
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], capture_output=True)


class RedisArm(Arm):
    name = "redis"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: Any = None

    def setup(self) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found (Debian package redis-server; .ci/install installs it)")
        port = free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_path = self.workdir / "redis.log"
        self.proc = procs.spawn([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", str(self.workdir), "--protected-mode", "yes"], log_path)
        self.client = redis.Redis(host="127.0.0.1", port=port)

        def answers() -> bool:
            try:
                return bool(self.client.ping())
            except redis.ConnectionError:
                return False

        procs.wait_ready(self.proc, answers, timeout=15, what="redis-server", log_path=log_path)

    def write(self, key: str, data: bytes) -> None:
        self.client.set(key, data)

    def read(self, key: str, buf: bytearray) -> int | None:
        v = self.client.get(key)
        if v is None:
            return None
        buf[: len(v)] = v
        return len(v)

    def cleanup(self, keys: list[str]) -> None:
        if keys:
            self.client.delete(*keys)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc is not None:
            procs.stop(self.proc, grace=5)


def tcp_stream_gbps(nbytes: int, reps: int) -> list[float]:
    """One loopback TCP stream, sendall -> recv_into a preallocated buffer: the network ceiling here."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    done: list[float] = []

    def receiver() -> None:
        conn, _ = srv.accept()
        buf = memoryview(bytearray(nbytes))
        with conn:
            for _ in range(reps):
                t0 = time.perf_counter()
                n = 0
                while n < nbytes:
                    got = conn.recv_into(buf[n:])
                    if not got:
                        return
                    n += got
                done.append(time.perf_counter() - t0)
                conn.sendall(b"k")

    th = threading.Thread(target=receiver, daemon=True)
    th.start()
    data = os.urandom(nbytes)
    out = []
    with socket.create_connection(("127.0.0.1", port)) as c:
        for _ in range(reps):
            t0 = time.perf_counter()
            c.sendall(data)
            c.recv(1)  # receiver got everything
            out.append(_gbps(nbytes, time.perf_counter() - t0))
    th.join(timeout=5)
    srv.close()
    return out


def run_arm(arm: Arm, size: int, reps: int, raw: list[dict[str, Any]]) -> None:
    """reps x (write a fresh object, read it back into a preallocated buffer); first read is verified."""
    data = os.urandom(size)
    buf = bytearray(size)
    keys = [f"warmup-{size}-{os.getpid()}"]  # first object pays connection/setup costs: not measured
    arm.write(keys[0], data)
    arm.read(keys[0], buf)
    for rep in range(reps):
        key = f"obj-{size}-{rep}-{os.getpid()}"
        keys.append(key)
        t0 = time.perf_counter()
        arm.write(key, data)
        tw = time.perf_counter() - t0
        if isinstance(arm, L2fsArm):
            arm.check_placement(key)
        t0 = time.perf_counter()
        n = arm.read(key, buf)
        tr = time.perf_counter() - t0
        if n != size or (rep == 0 and bytes(buf) != data):
            raise RuntimeError(f"{arm.name}: read back {n} bytes of {size}, or wrong bytes")
        raw.append({"arm": arm.name, "size": size, "rep": rep, "write_s": tw, "read_s": tr,
                    "write_gbps": _gbps(size, tw), "read_gbps": _gbps(size, tr)})
    arm.cleanup(keys)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench l2", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None, help="object sizes in MiB, comma separated (default 14.7,32)")
    p.add_argument("--reps", type=int, default=7, help="objects per size and arm (default 7)")
    p.add_argument("--quick", action="store_true", help="tiny run for CI: 1 MiB objects, 2 reps")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where JSON/CSV go")
    p.add_argument("--dir", type=Path, default=None, help="scratch dir (default: a temp dir on local disk)")
    p.add_argument("--no-mount", action="store_true", help="skip the FUSE mount arm")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis arm")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        sizes, reps = [1 * MIB], 2
    else:
        reps = args.reps
        sizes = DEFAULT_SIZES
    if args.sizes:
        try:
            sizes = [int(float(s) * MIB) for s in args.sizes.split(",")]
        except ValueError:
            print(f"kvtier bench l2: bad --sizes {args.sizes!r} (want MiB numbers like 14.7,32)", file=sys.stderr)
            return 2
    if reps < 1 or any(s <= 0 for s in sizes):
        print("kvtier bench l2: --reps and --sizes must be positive", file=sys.stderr)
        return 2

    from l2fs.local import LocalCluster

    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-l2-", dir=args.dir))
    raw: list[dict[str, Any]] = []
    arms: list[Arm] = []
    try:
        log(f"starting l2fs (master + 2 workers) under {scratch}")
        with LocalCluster(scratch / "l2fs", workers=2) as cluster:
            n1, n2 = cluster.workers[0].node_id, cluster.workers[1].node_id
            c1, c2 = cluster.client(node_id=n1), cluster.client(node_id=n2)
            arms.append(LocalDir(scratch / "local"))
            arms.append(L2fsArm("l2fs same node", c1, c1, "/bench-l2/same", n1))
            arms.append(L2fsArm("l2fs cross node", c1, c2, "/bench-l2/cross", n1))
            if not args.no_mount:
                arms.append(MountArm(scratch / "mnt", cluster.master, n1, scratch / "mount.log"))
            if not args.no_redis:
                arms.append(RedisArm(scratch / "redis"))
            try:
                for arm in arms:
                    arm.setup()
                for size in sizes:
                    for arm in arms:
                        log(f"{arm.name}: {reps} x {size / MIB:.1f} MiB")
                        run_arm(arm, size, reps, raw)
            finally:
                for arm in arms:
                    try:
                        arm.close()
                    except Exception as e:  # noqa: BLE001 - any failure here is reported, never fatal
                        log(f"closing {arm.name}: {e!r}")
                c1.close()
                c2.close()
            placement = {a.name: a.placement for a in arms if isinstance(a, L2fsArm)}
        tcp = {size: tcp_stream_gbps(size, reps) for size in sizes}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary: dict[str, Any] = {"sizes": sizes, "reps": reps, "arms": {}, "tcp_gbps": {}, "placement": placement}
    rows = []
    for size in sizes:
        med: dict[str, tuple[float, float]] = {}
        for arm in arms:
            rs = [r for r in raw if r["arm"] == arm.name and r["size"] == size]
            med[arm.name] = (pct([r["write_gbps"] for r in rs], 50), pct([r["read_gbps"] for r in rs], 50))
        base_w, base_r = med["local dir"]
        redis_r = med.get("redis", (float("nan"), float("nan")))[1]
        for arm in arms:
            w, r = med[arm.name]
            rs = [x for x in raw if x["arm"] == arm.name and x["size"] == size]
            p90_read_ms = pct([x["read_s"] * 1e3 for x in rs], 90)
            rows.append([f"{size / MIB:.1f}", arm.name, fmt(w, 2), fmt(r, 2), fmt(p90_read_ms, 1),
                         fmt(w / base_w, 2), fmt(r / base_r, 2), fmt(r / redis_r, 2)])
            summary["arms"].setdefault(f"{size}", {})[arm.name] = {
                "write_gbps_p50": w, "read_gbps_p50": r, "read_ms_p90": p90_read_ms,
                "write_vs_local": w / base_w, "read_vs_local": r / base_r, "read_vs_redis": r / redis_r}
        t = pct(tcp[size], 50)
        summary["tcp_gbps"][f"{size}"] = t
        rows.append([f"{size / MIB:.1f}", "loopback TCP (1 stream)", fmt(t, 2), fmt(t, 2), "-",
                     fmt(t / base_w, 2), fmt(t / base_r, 2), "-"])
    print(table(["MiB", "arm", "write GB/s p50", "read GB/s p50", "read ms p90", "write x local",
                 "read x local", "read x redis"], rows,
                title=f"L2 data path, {reps} objects per size and arm (p50 over objects; reads into a "
                      "preallocated buffer)"))
    if "l2fs same node" in summary["arms"].get(f"{sizes[0]}", {}):
        s = summary["arms"][f"{sizes[0]}"]["l2fs same node"]
        print(f"goal: l2fs same-node read >= 0.8x local dir (got {fmt(s['read_vs_local'], 2)}x) and >= 2x "
              f"Redis GET (got {fmt(s['read_vs_redis'], 2)}x) at {sizes[0] / MIB:.1f} MiB")
    for name, nodes in placement.items():
        print(f"{name}: objects placed on {sorted({n for ns in nodes for n in ns})}")
    for p in write_results(args.out, "l2", summary, raw):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
