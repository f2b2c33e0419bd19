"""`kvtier bench l2`: the L2 data path side by side, one run, the same bytes.

Arms: a plain local directory (LMCache's stock fs:// target and the physical limit on this machine), the l2fs
native client on the same node (short-circuit) and across nodes (gRPC from the other node's worker), the l2fs
FUSE mount, and Redis (HyperPod's other L2 backend; Debian's redis-server started here on a free loopback
port). A raw loopback TCP stream is printed as the network limit. Ratios are to the local directory.
Objects: 14.7 MiB (one 256-token chunk of a 7B model: 256 x 56 KiB) and 32 MiB by default.

--netns [--link RATE]: the workers run in node namespaces (l2fs.testing.netns); the l2fs client arms run as child
processes inside the nodes (a worker's data address is reachable only there): same node = a node-1 client,
cross node = written by node-1, read by node-2 over the (shaped) link, mount = node-1's FUSE mount started in
its namespace. The plain TCP throughput node-1 -> node-2 of the same link is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.bench.common import fmt, link_line, pct, shaper_bound, table, write_results
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


def run_arm(arm: Arm, size: int, reps: int, raw: list[dict[str, Any]], data: bytes | None = None) -> None:
    """reps x (write a fresh object, read it back into a preallocated buffer); first read is verified."""
    data = os.urandom(size) if data is None else data
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


def _object(size: int, seed: int) -> bytes:
    """The same bytes in every process (writer and reader children verify against it)."""
    return random.Random(seed * 1_000_003 + size).randbytes(size)


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Run inside a node namespace (`--child`): role both (write+read, one client), write or read, over
    spec's keys; returns raw rows (only the timed half for write/read) and placements."""
    from l2fs.client import Client

    c = Client(spec["master"], node_id=spec["node_id"], token=spec.get("token"), tls_ca=spec.get("tls_ca"))
    arm = L2fsArm(spec["arm"], c, c, spec["prefix"], spec["node_id"])
    raw: list[dict[str, Any]] = []
    role, reps, tag = spec["role"], spec["reps"], spec["tag"]
    try:
        for size in spec["sizes"]:
            data = _object(size, spec["seed"])
            buf = bytearray(size)
            if role == "both":
                run_arm(arm, size, reps, raw, data=data)
                continue
            for rep in range(-1, reps):  # rep -1: the warm-up object (connections, setup), not recorded
                key = f"obj-{size}-{rep}-{tag}"
                t0 = time.perf_counter()
                if role == "write":
                    arm.write(key, data)
                    dt = time.perf_counter() - t0
                    arm.check_placement(key)
                else:
                    n = arm.read(key, buf)
                    dt = time.perf_counter() - t0
                    if n != size or (rep == 0 and bytes(buf) != data):
                        raise RuntimeError(f"{arm.name}: read back {n} bytes of {size}, or wrong bytes")
                if rep >= 0:
                    raw.append({"arm": arm.name, "size": size, "rep": rep, f"{role}_s": dt,
                                f"{role}_gbps": _gbps(size, dt)})
    finally:
        c.close()
    return {"raw": raw, "placement": arm.placement}


def _run_child(net: Any, node: int, spec: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """`python -m kvtier.bench.l2 --child` in node's network namespace; the spec on stdin, JSON back."""
    argv = net.wrap(node, [sys.executable, "-m", "kvtier.bench.l2", "--child"])
    with open(log_path, "ab") as err:
        r = subprocess.run(argv, input=json.dumps(spec).encode(), stdout=subprocess.PIPE, stderr=err,
                           timeout=600, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"bench child on node-{node} ({spec['arm']}, {spec['role']}) exited {r.returncode};"
                           f" see {log_path}")
    return dict(json.loads(r.stdout))


class NetnsMountArm(LocalDir):
    """Node-1's l2fs FUSE mount, started inside its namespace; this process uses it as a directory."""

    name = "l2fs mount"

    def __init__(self, cluster: Any, mountpoint: Path) -> None:
        self.cluster, self.mountpoint = cluster, mountpoint
        self.root = mountpoint / "bench-l2"

    def setup(self) -> None:
        self.cluster.mount(0, self.mountpoint)
        self.root.mkdir(exist_ok=True)

    def close(self) -> None:
        if 0 in self.cluster.mounts:
            self.cluster.unmount(0)


def run_netns(args: argparse.Namespace, sizes: list[int], reps: int, scratch: Path,
              raw: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any], dict[int, list[float]]]:
    """The arms with workers in node namespaces; returns arm names (table order), placements and the link's
    plain TCP throughput node-1 -> node-2 per size (bits/s)."""
    from l2fs.testing.cluster import LocalCluster
    from l2fs.testing.netns import NetnsCluster

    arms: list[Arm] = [LocalDir(scratch / "local")]
    tcp: dict[int, list[float]] = {}
    placement: dict[str, Any] = {}
    log(f"starting a 2-node namespace cluster (link {args.link or 'unshaped'}) and l2fs under {scratch}")
    with NetnsCluster(2, link=args.link) as net, \
            LocalCluster(scratch / "l2fs", workers=2, netns=net) as cluster:
        log(f"namespaces {net.prefix}-*, subnet {net.subnet}")
        if not args.no_mount:
            arms.append(NetnsMountArm(cluster, scratch / "mnt"))
        if not args.no_redis:
            arms.append(RedisArm(scratch / "redis"))
        n1, n2 = cluster.workers[0].node_id, cluster.workers[1].node_id
        base = {"master": cluster.master, "token": cluster.token, "tls_ca": cluster.tls_ca, "sizes": sizes,
                "reps": reps, "seed": 1, "tag": str(os.getpid())}
        child_log = scratch / "children.log"
        same = {**base, "arm": "l2fs same node", "prefix": "/bench-l2/same", "node_id": n1, "role": "both"}
        log(f"l2fs same node: {reps} x {[round(s / MIB, 1) for s in sizes]} MiB in {net.nodes[0].netns}")
        got = _run_child(net, 1, same, child_log)
        raw += got["raw"]
        placement["l2fs same node"] = got["placement"]
        cross = {**base, "arm": "l2fs cross node", "prefix": "/bench-l2/cross"}
        log("l2fs cross node: written on node-1, read on node-2")
        w = _run_child(net, 1, {**cross, "node_id": n1, "role": "write"}, child_log)
        r = _run_child(net, 2, {**cross, "node_id": n2, "role": "read"}, child_log)
        reads = {(x["size"], x["rep"]): x for x in r["raw"]}
        for x in w["raw"]:
            raw.append({**x, **reads[(x["size"], x["rep"])]})
        placement["l2fs cross node"] = w["placement"]
        _cleanup_cross(cluster, str(base["tag"]), sizes, reps)
        run_arms(arms, sizes, reps, raw)
        for size in sizes:  # at least 16 MiB so the shaper's burst does not decide the number
            tcp[size] = [net.tcp_throughput(1, 2, max(size, 16 * MIB)) for _ in range(reps)]
    names = [arms[0].name, "l2fs same node", "l2fs cross node", *(a.name for a in arms[1:])]
    return names, placement, tcp


def _cleanup_cross(cluster: Any, tag: str, sizes: list[int], reps: int) -> None:
    """Remove the cross arm's objects (metadata calls: fine from the host through the forwarder); the
    same-node child removes its own."""
    c = cluster.client()
    try:
        for size in sizes:
            for rep in range(-1, reps):
                try:
                    c.rm(f"/bench-l2/cross/obj-{size}-{rep}-{tag}")
                except Exception:  # noqa: BLE001 - leftovers only cost space in a scratch cluster
                    pass
    finally:
        c.close()


def run_arms(arms: list[Arm], sizes: list[int], reps: int, raw: list[dict[str, Any]]) -> None:
    """Set up every arm, run each size on each arm in turn, close them all (even after a failure)."""
    try:
        for arm in arms:
            arm.setup()
        for size in sizes:
            for arm in arms:
                log(f"{arm.name}: {reps} x {size / MIB:.1f} MiB")
                run_arm(arm, size, reps, raw)
    finally:
        _close_arms(arms)


def _close_arms(arms: list[Arm]) -> None:
    for arm in arms:
        try:
            arm.close()
        except Exception as e:  # noqa: BLE001 - any failure here is reported, never fatal
            log(f"closing {arm.name}: {e!r}")


def run_loopback(args: argparse.Namespace, sizes: list[int], reps: int, scratch: Path,
                 raw: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The arms on one loopback: in-process clients of node-1 and node-2, the mount as a subprocess."""
    from l2fs.testing.cluster import LocalCluster

    arms: list[Arm] = []
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
            run_arms(arms, sizes, reps, raw)
        finally:
            c1.close()
            c2.close()
    return [a.name for a in arms], {a.name: a.placement for a in arms if isinstance(a, L2fsArm)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench l2", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None, help="object sizes in MiB, comma separated (default 14.7,32)")
    p.add_argument("--reps", type=int, default=7, help="objects per size and arm (default 7)")
    p.add_argument("--quick", action="store_true", help="tiny run for CI: 1 MiB objects, 2 reps")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where JSON/CSV go")
    p.add_argument("--dir", type=Path, default=None, help="scratch dir (default: a temp dir on local disk)")
    p.add_argument("--no-mount", action="store_true", help="skip the FUSE mount arm")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis arm")
    p.add_argument("--netns", action="store_true",
                   help="workers in node network namespaces; cross node crosses a real (veth) link")
    p.add_argument("--link", default=None, metavar="RATE", help="with --netns: each node's link rate, e.g. 2gbit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # an arm inside a node (--netns)
    p.add_argument("--metadata", action="store_true",
                   help="the master's metadata rates instead (own flags: kvtier bench l2 --metadata --help)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--metadata" in argv:  # a different benchmark with its own flags (kvtier/bench/l2_metadata.py)
        from kvtier.bench.l2_metadata import main as metadata_main

        return metadata_main([a for a in argv if a != "--metadata"])
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(child_main(json.load(sys.stdin))))
        return 0
    if args.link and not args.netns:
        print("kvtier bench l2: --link needs --netns (loopback has no link to shape)", file=sys.stderr)
        return 2
    if args.netns:
        from l2fs.testing.netns import NetnsError, check_host, parse_rate

        try:
            if args.link:
                parse_rate(args.link)
            check_host()
        except NetnsError as e:
            print(f"kvtier bench l2: {e}", file=sys.stderr)
            return 2
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

    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-l2-", dir=args.dir))
    raw: list[dict[str, Any]] = []
    try:
        if args.netns:
            names, placement, tcp_bps = run_netns(args, sizes, reps, scratch, raw)
            tcp = {size: [b / 8e9 for b in v] for size, v in tcp_bps.items()}  # GB/s like the arms
        else:
            names, placement = run_loopback(args, sizes, reps, scratch, raw)
            tcp = {size: tcp_stream_gbps(size, reps) for size in sizes}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary: dict[str, Any] = {"sizes": sizes, "reps": reps, "arms": {}, "tcp_gbps": {}, "placement": placement,
                               "netns": args.netns, "link": args.link}
    rows = []
    where = f"netns, link {args.link or 'unshaped'}" if args.netns else "loopback"
    tcp_label = "link TCP node-1 -> node-2 (1 stream)" if args.netns else "loopback TCP (1 stream)"
    for size in sizes:
        med: dict[str, tuple[float, float]] = {}
        for name in names:
            rs = [r for r in raw if r["arm"] == name and r["size"] == size]
            med[name] = (pct([r["write_gbps"] for r in rs], 50), pct([r["read_gbps"] for r in rs], 50))
        base_w, base_r = med["local dir"]
        redis_r = med.get("redis", (float("nan"), float("nan")))[1]
        for name in names:
            w, r = med[name]
            rs = [x for x in raw if x["arm"] == name and x["size"] == size]
            p90_read_ms = pct([x["read_s"] * 1e3 for x in rs], 90)
            rows.append([f"{size / MIB:.1f}", name, fmt(w, 2), fmt(r, 2), fmt(p90_read_ms, 1),
                         fmt(w / base_w, 2), fmt(r / base_r, 2), fmt(r / redis_r, 2)])
            summary["arms"].setdefault(f"{size}", {})[name] = {
                "write_gbps_p50": w, "read_gbps_p50": r, "read_ms_p90": p90_read_ms,
                "write_vs_local": w / base_w, "read_vs_local": r / base_r, "read_vs_redis": r / redis_r}
        t = pct(tcp[size], 50)
        summary["tcp_gbps"][f"{size}"] = t
        rows.append([f"{size / MIB:.1f}", tcp_label, fmt(t, 2), fmt(t, 2), "-",
                     fmt(t / base_w, 2), fmt(t / base_r, 2), "-"])
        cross_r = med.get("l2fs cross node", (float("nan"), float("nan")))[1]
        summary["arms"][f"{size}"]["l2fs cross node"]["read_vs_link_tcp"] = cross_r / t
    print(table(["MiB", "arm", "write GB/s p50", "read GB/s p50", "read ms p90", "write x local",
                 "read x local", "read x redis"], rows,
                title=f"L2 data path ({where}), {reps} objects per size and arm (p50 over objects; reads into "
                      "a preallocated buffer)"))
    for size in sizes:
        ratio = summary["arms"][f"{size}"]["l2fs cross node"]["read_vs_link_tcp"]
        print(f"{size / MIB:.1f} MiB: l2fs cross-node read / {tcp_label} = {fmt(ratio, 2)}")
    if args.netns:
        all_bps = [b for v in tcp_bps.values() for b in v]
        summary["link_tcp_gbit"] = pct(all_bps, 50) / 1e9
        summary["shaper_bound"] = shaper_bound(pct(all_bps, 50), args.link)
        print(link_line(all_bps, args.link, "node-1 -> node-2"))
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
