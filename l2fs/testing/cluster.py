"""Local l2fs cluster: a master and N workers as real processes (each worker its own node), on loopback or,
with a `l2fs.testing.netns.NetnsCluster`, the master in its control namespace and worker K in node K's namespace.

Used by `l2fs local`, tests and `kvtier up`:

    with LocalCluster(base_dir, workers=2) as cluster:
        cluster.master                  # "127.0.0.1:PORT"
        cluster.workers[i].node_id      # "node-1", "node-2", ...
        cluster.workers[i].data_dir     # pathlib.Path
        cluster.kill_worker(i, signal.SIGKILL); cluster.start_worker(i)
        cluster.kill_master(); cluster.start_master()
        cluster.client(node_id="node-1")  # an l2fs.Client

The master keeps its port across kill_master()/start_master() so workers find it again; a restarted
worker keeps its data dir (and so its blocks and worker id) but may get a new port.

With `netns=NetnsCluster(...)` (the caller owns it and closes it after this cluster): every process binds
its namespace's address (`cluster.master` is the control address, as nodes reach it), and
`cluster.host_master` is a 127.0.0.1 forwarder to it for host-side clients (metadata: the workers' data
addresses are reachable only from inside the namespaces). `cluster.mount(i, path)` starts node i's FUSE
mount inside its namespace (visible to every process: only the network namespace is entered).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2fs import procs
from l2fs.client import Client, L2fsError
from l2fs.common import ensure_block_key

if TYPE_CHECKING:
    from l2fs.testing.netns import NetnsCluster


@dataclass
class LocalWorker:
    index: int
    node_id: str
    data_dir: Path
    capacity: str | None = None
    proc: subprocess.Popen | None = None
    port: int = 0
    metrics_port: int | None = None
    worker_id: str = ""
    extra_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"     # the address it binds and advertises (its node's, in a netns cluster)
    where: Any = None           # its network namespace (a netns node), None on loopback

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster(procs.Started):
    """Master + `workers` workers as subprocesses under base_dir (logs in base_dir/logs).

    capacity: per-worker capacity like "1G" (default: the disk's free space).
    heartbeat_timeout: master's dead-worker timeout in seconds.
    token / tls_*: passed to every process (and to clients made with .client()).
    metrics: give every process a /metrics port (worker.metrics_port, .master_metrics_port).
    block_key: masters get `--block-key-file <base>/block-key` (made once, kept across restarts: minted block
        ids are MACs, commits and reports of others are not published); False = uuid4 ids, no check.
    shards: masters of a path-hash sharded namespace (`l2fs master --shard K/N`); `.master` is then the
        "m0;m1" list every role takes, `.master_procs[K]`/`.master_ports[K]` shard K's (the unsuffixed
        attributes are shard 0's), start_master/kill_master take a shard (default: all).
    """

    def __init__(self, base_dir: str | os.PathLike[str], workers: int = 2, *, capacity: str | None = None,
                 heartbeat_timeout: float = 10.0, heartbeat_interval: float = 1.0, token: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
                 metrics: bool = True, master_args: list[str] | None = None,
                 worker_args: list[str] | None = None, start_timeout: float = 30.0,
                 netns: NetnsCluster | None = None, journal: bool = True, shards: int = 1,
                 block_key: bool = True) -> None:
        if shards < 1:
            raise ValueError("shards must be >= 1")
        self.base = Path(base_dir).resolve()
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "logs").mkdir(exist_ok=True)
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval
        self.token, self.tls_cert, self.tls_key, self.tls_ca = token, tls_cert, tls_key, tls_ca
        self.metrics = metrics
        self.master_args = list(master_args or [])
        if shards > 1 and "--journal" in self.master_args:
            raise ValueError("each shard's master needs its own journal: leave --journal to LocalCluster")
        # pending deletes/renames survive a master restart (kill_master/start_master keep the file)
        self.journal = journal and "--journal" not in self.master_args
        # the same key for every shard's master and every restart (what a deployment's Secret gives them)
        self.block_key_file: Path | None = None
        if block_key and "--block-key-file" not in self.master_args:
            self.block_key_file = ensure_block_key(self.base / "block-key")
            self.master_args += ["--block-key-file", str(self.block_key_file)]
        self.start_timeout = start_timeout
        self.shards = shards
        self.master_ports = [0] * shards
        self.master_metrics_ports: list[int | None] = [None] * shards
        self.master_procs: list[subprocess.Popen | None] = [None] * shards
        self.netns = netns
        if netns is not None and workers > len(netns.nodes):
            raise ValueError(f"{workers} workers need {workers} namespace nodes, the cluster has {len(netns.nodes)}")
        self.master_host = netns.ctl.addr if netns is not None else "127.0.0.1"
        self._master_forwards: dict[int, Any] = {}
        self.mounts: dict[int, tuple[Path, subprocess.Popen]] = {}
        self.workers = [LocalWorker(i, f"node-{i + 1}", self.base / f"worker-{i + 1}", capacity,
                                    extra_args=list(worker_args or [])) for i in range(workers)]
        if netns is not None:
            for w, n in zip(self.workers, netns.nodes, strict=False):
                w.node_id, w.host, w.where = n.name, n.addr, n
        _LIVE.add(self)

    # shard 0's master under the names a one-master cluster always had
    @property
    def master_port(self) -> int:
        return self.master_ports[0]

    @property
    def master_proc(self) -> subprocess.Popen | None:
        return self.master_procs[0]

    @property
    def master_metrics_port(self) -> int | None:
        return self.master_metrics_ports[0]

    @property
    def master(self) -> str:
        """The masters' addresses as the nodes (and any process started in a namespace) reach them
        ("host:port", or "host:p0;host:p1" for shards)."""
        return ";".join(f"{self.master_host}:{port}" for port in self.master_ports)

    @property
    def host_master(self) -> str:
        """The master's address for a process on the host: itself on loopback, else a 127.0.0.1 forwarder."""
        if self.netns is None:
            return self.master
        for k, port in enumerate(self.master_ports):
            if k not in self._master_forwards:
                self._master_forwards[k] = self.netns.forward(port, where="ctl")
        return ";".join(str(self._master_forwards[k].address) for k in range(self.shards))

    # ---------- lifecycle (context manager: procs.Started) ----------

    def start(self) -> None:
        """Start the master and all workers; return when every worker is registered and alive."""
        self.start_master()
        for i in range(len(self.workers)):
            self.start_worker(i, wait=False)
        self.wait_workers(len(self.workers))

    def stop(self) -> None:
        for i in sorted(self.mounts):
            self.unmount(i)
        for i in range(len(self.workers)):
            self.kill_worker(i, signal.SIGTERM)
        self.kill_master(signal.SIGTERM)

    def _security_args(self) -> list[str]:
        args = []
        if self.token:
            args += ["--token", self.token]
        if self.tls_cert and self.tls_key:
            args += ["--tls-cert", self.tls_cert, "--tls-key", self.tls_key]
        if self.tls_ca:
            args += ["--tls-ca", self.tls_ca]
        return args

    def _argv(self, where: Any, argv: list[str]) -> list[str]:
        """argv as started: inside `where`'s network namespace in a netns cluster."""
        return self.netns.wrap(where, argv) if self.netns is not None else argv

    def _spawn(self, name: str, args: list[str], port_path: Path,
               where: Any = "ctl") -> tuple[subprocess.Popen, dict]:
        port_path.unlink(missing_ok=True)
        log_path = self.base / "logs" / f"{name}.log"
        env = dict(os.environ)
        env.pop("L2FS_TOKEN", None)  # only what this cluster was told
        proc = procs.spawn(self._argv(where, [sys.executable, "-m", "l2fs.cli", *args, "--port-file",
                                              str(port_path)]), log_path, env=env)
        try:
            info = procs.wait_ready(proc, procs.port_file(port_path), timeout=self.start_timeout,
                                    what=f"l2fs {name}", log_path=log_path, interval=0.05)
        except procs.ProcessError:
            procs.stop(proc, sig=signal.SIGKILL)
            raise
        return proc, info

    def start_master(self, shard: int | None = None) -> None:
        """(Re)start the master (of one shard; default all) on its previous port (a free one the first time)."""
        for k in range(self.shards) if shard is None else [shard]:
            name = "master" if k == 0 else f"master-{k}"
            args = ["master", "--host", self.master_host, "--port", str(self.master_ports[k]),
                    "--heartbeat-timeout", str(self.heartbeat_timeout), *self._security_args(), *self.master_args]
            if self.shards > 1:
                args += ["--shard", f"{k}/{self.shards}"]
            if self.journal:
                args += ["--journal", str(self.base / f"{name}-journal.sqlite3")]
            if self.metrics:
                args += ["--metrics-port", "0"]
            self.master_procs[k], info = self._spawn(name, args, self.base / f"{name}.port")
            self.master_ports[k] = info["port"]
            self.master_metrics_ports[k] = info.get("metrics_port")

    def kill_master(self, sig: int = signal.SIGKILL, shard: int | None = None) -> None:
        for k in range(self.shards) if shard is None else [shard]:
            procs.stop(self.master_procs[k], sig=sig, grace=10)
            self.master_procs[k] = None

    def start_worker(self, i: int, *, wait: bool = True) -> None:
        """(Re)start worker i on its data dir; with wait, return once the master lists it alive."""
        w = self.workers[i]
        spec = f"{w.data_dir}:{w.capacity}" if w.capacity else str(w.data_dir)
        args = ["worker", "--master", self.master, "--host", w.host, "--port", "0", "--data-dir", spec,
                "--node-id", w.node_id, "--heartbeat-interval", str(self.heartbeat_interval),
                *self._security_args(), *w.extra_args]
        if self.metrics:
            args += ["--metrics-port", "0"]
        w.proc, info = self._spawn(f"worker-{i + 1}", args, self.base / f"worker-{i + 1}.port", w.where)
        w.port, w.metrics_port, w.worker_id = info["port"], info.get("metrics_port"), info.get("worker_id", "")
        if wait:
            self.wait_workers(ids=[w.worker_id])

    def kill_worker(self, i: int, sig: int = signal.SIGKILL) -> None:
        w = self.workers[i]
        procs.stop(w.proc, sig=sig, grace=10)
        w.proc = None

    def wait_workers(self, n: int | None = None, *, ids: list[str] | None = None,
                     timeout: float | None = None) -> None:
        """Block until n workers (or the given worker ids, at their current address) are alive."""
        deadline = time.monotonic() + (timeout or self.start_timeout)
        with self.client() as c:
            while True:
                try:
                    rep = c.report()
                    alive = {w.worker_id: w.address for w in rep.workers if w.alive}
                    if ids is not None:
                        want = {w.worker_id: w.address for w in self.workers if w.worker_id in ids}
                        if all(alive.get(k) == v for k, v in want.items()) and self._workers_ready(ids):
                            return
                    elif len(alive) >= (n or 0) and self._workers_ready(list(alive)):
                        return
                except L2fsError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"l2fs workers not registered in time; logs in {self.base / 'logs'}")
                time.sleep(0.05)

    def _workers_ready(self, ids: list[str]) -> bool:
        """Whether those of our workers have their master's registration answer themselves (their /health
        "ready"): the master lists a worker a moment before the worker knows its mode, and until then it
        refuses every block call. Loopback workers with a metrics port only (others: trusted as listed)."""
        for w in self.workers:
            if w.worker_id not in ids or self.netns is not None or not w.metrics_port:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/readyz", timeout=1) as r:
                    if r.status != 200:
                        return False
            except OSError:  # 503 (HTTPError) while not ready, or not listening yet
                return False
        return True

    def client(self, node_id: str | None = None, **kwargs: Any) -> Client:
        """A Client for this cluster (token/TLS filled in); node_id enables local-first/short-circuit.
        In a netns cluster it reaches the master through the host forwarder (metadata calls only)."""
        kwargs.setdefault("token", self.token)
        kwargs.setdefault("tls_ca", self.tls_ca)
        return Client(self.host_master, node_id=node_id or "", **kwargs)

    def mount(self, i: int, mountpoint: str | os.PathLike[str], *args: str, timeout: float = 30.0) -> Path:
        """Mount the cluster at mountpoint as worker i's node (`l2fs mount --node-id`, in its namespace)."""
        from l2fs.fuse import mount_type

        w = self.workers[i]
        mp = Path(mountpoint).resolve()
        mp.mkdir(parents=True, exist_ok=True)
        log_path = self.base / "logs" / f"mount-{i + 1}.log"
        argv = [sys.executable, "-m", "l2fs.cli", "mount", str(mp), "--master", self.master, "--node-id",
                w.node_id, *self._security_args_client(), *args]
        env = {k: v for k, v in os.environ.items() if k != "L2FS_TOKEN"}
        proc = procs.spawn(self._argv(w.where, argv), log_path, env=env)
        if self.netns is not None:
            self.netns.register_mount(mp)  # a crashed launcher's mount is removed by netns.cleanup()
        self.mounts[i] = (mp, proc)
        procs.wait_ready(proc, lambda: mount_type(mp) == "fuse.l2fs", timeout=timeout,
                         what=f"l2fs mount of {w.node_id}", log_path=log_path, interval=0.05)
        return mp

    def unmount(self, i: int) -> None:
        """Stop node i's mount (SIGTERM unmounts cleanly); a lazy fusermount if it is still mounted."""
        from l2fs.fuse import mount_type

        mp, proc = self.mounts.pop(i)
        procs.stop(proc, sig=signal.SIGTERM, grace=10)
        if mount_type(mp) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True, check=False)

    def _security_args_client(self) -> list[str]:
        """Token and CA for a client process (a mount): no server certificate."""
        args = ["--token", self.token] if self.token else []
        return args + (["--tls-ca", self.tls_ca] if self.tls_ca else [])


_LIVE: weakref.WeakSet[LocalCluster] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Never leave l2fs processes behind when the launching interpreter exits without stop()."""
    for cluster in list(_LIVE):
        try:
            cluster.stop()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def main(argv: list[str] | None = None) -> int:
    """`l2fs local --workers 2 --dir ./.l2fs [--netns [--link RATE]]`: run a cluster in the foreground until
    Ctrl-C; `--cleanup` removes namespaces, mounts and processes left by crashed launchers."""
    import argparse
    import contextlib

    p = argparse.ArgumentParser(prog="l2fs local", description="Run a master and N workers on loopback, or "
                                "each worker in its own network namespace (--netns).")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dir", default="./.l2fs", help="base dir for data, logs and port files")
    p.add_argument("--capacity", default=None, help="per-worker capacity, e.g. 2G (default: free disk)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0)
    p.add_argument("--shards", type=int, default=1,
                   help="masters of a path-hash sharded namespace (default 1); clients take the printed "
                        "'host:p0;host:p1' list")
    p.add_argument("--token", default=None)
    p.add_argument("--no-block-key", action="store_true",
                   help="no <dir>/block-key for the master: uuid4 block ids, reported blocks not verified")
    p.add_argument("--netns", action="store_true",
                   help="master in a control network namespace, worker K in node K's (needs root, ip, tc, nsenter)")
    p.add_argument("--link", default=None, metavar="RATE", help="with --netns: rate of each node's link, e.g. 2gbit")
    p.add_argument("--cleanup", action="store_true",
                   help="remove what crashed --netns launchers left (namespaces, mounts, processes), then exit")
    args = p.parse_args(argv)
    if args.link and not args.netns:
        p.error("--link needs --netns (loopback has no link to shape)")
    if args.cleanup:
        return cleanup_leftovers("l2fs local")
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with contextlib.ExitStack() as outer:
        net = None
        if args.netns:
            from l2fs.testing.netns import NetnsCluster, NetnsError

            try:
                net = outer.enter_context(NetnsCluster(args.workers, link=args.link))
            except NetnsError as e:
                print(f"l2fs local: {e}", file=sys.stderr)
                return 2
        cluster = LocalCluster(args.dir, args.workers, capacity=args.capacity,
                               heartbeat_timeout=args.heartbeat_timeout, token=args.token, netns=net,
                               shards=args.shards, block_key=not args.no_block_key)
        with cluster:
            _print_cluster(cluster)
            while not stop:
                time.sleep(0.2)
                dead = [w for w in cluster.workers if not w.alive]
                if dead or any(m is not None and m.poll() is not None for m in cluster.master_procs):
                    print("l2fs local: a process exited unexpectedly; stopping", file=sys.stderr)
                    return 1
    return 0


def _print_cluster(cluster: LocalCluster) -> None:
    """Addresses of a started cluster, and how to use it from the host (or a node's namespace)."""
    net = cluster.netns
    print(f"l2fs local cluster: master {cluster.master} (metrics http://{cluster.master_host}:"
          f"{cluster.master_metrics_port}/metrics)", flush=True)
    for w in cluster.workers:
        where = f" netns={w.where.netns}" if w.where is not None else ""
        print(f"  worker {w.worker_id} node={w.node_id} at {w.address}{where} data={w.data_dir}", flush=True)
    if net is None:
        shown = f"'{cluster.master}'" if ";" in cluster.master else cluster.master  # ';' needs shell quotes
        print(f"export L2FS_MASTER={shown}   # then: l2fs put/get/ls ... ; Ctrl-C stops", flush=True)
        return
    print(f"  namespaces {net.prefix}-*, subnet {net.subnet}, link {net.link or 'unshaped'}", flush=True)
    print(f"from the host (metadata only): L2FS_MASTER={cluster.host_master} l2fs ls /", flush=True)
    n1 = net.nodes[0].netns
    print(f"as node-1: l2fs netns exec {n1} -- env L2FS_MASTER={cluster.master} L2FS_NODE_ID=node-1 "
          f"l2fs put/get ...   ; Ctrl-C stops and removes everything", flush=True)


def cleanup_leftovers(prog: str) -> int:
    """`--cleanup`: l2fs.testing.netns.cleanup() of launchers whose process is gone (live ones are left alone)."""
    from l2fs.testing.netns import NetnsError, cleanup

    try:
        removed = cleanup()
    except NetnsError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    for name in removed:
        print(f"removed {name}")
    print(f"{prog} --cleanup: {len(removed)} leftover(s) removed", flush=True)
    return 0
