"""`kvtier up`: the whole stack on one machine, as real processes on loopback (or one network namespace per node).

l2fs master + N workers (each worker its own "node"), M vLLM CPU replicas with LMCache + the l2fs connector
(replica i lives on node i mod N), and the cache-aware router in front. The same `Stack` is reused by the
benchmarks (`kvtier bench ...`) so that they measure exactly what a user starts.

--mode plugin (default): replicas use our LMCache connector to l2fs; --mode mount: each node runs `l2fs mount`
(its own mountpoint under <dir>/mnt/<node>) and its replicas use stock LMCache `fs://` on it.
--lmcache-mode mp: LMCache's multiprocess mode instead of LMCache inside vLLM: each replica gets its own
`lmcache server` (the webhook's sidecar layout) with kvtier's l2fs L2 adapter, and vLLM runs LMCache's own MP
connector (engine_driven transfer, the one that runs on CPU); CPU, plugin mode, loopback only.
--netns [--link RATE]: master and router in a control namespace, node K (worker, mount, replicas) in its own,
each bound to its address, the router reached from the host through a 127.0.0.1 forwarder.

A state file `<dir>/up.json` lists the endpoints, node ids and log files, so that other commands
(`kvtier bench cross-pod --from-up <dir>/up.json`) can reuse a running stack instead of starting engines again.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from l2fs import procs
from l2fs.common import free_port

DEFAULT_DIR = Path(".kvtier")
STATE_NAME = "up.json"
MODES = ("plugin", "mount")
MOUNT_SERVERS = ("auto", "passthrough", "pyfuse3")  # --mode mount: which `l2fs mount` each node runs
LMCACHE_MODES = ("inprocess", "mp")  # mp: an `lmcache server` per replica (the webhook's sidecar layout)
MP_ONLY = ("--lmcache-mode mp runs on CPU replicas on loopback, with the server's l2fs adapter as the L2 (not with "
           "--mode mount, --netns or --device cuda: those combinations are untested)")


def log(msg: str) -> None:
    """Progress line on stderr (stdout stays for endpoints and results)."""
    print(f"[kvtier {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class _Planned:
    """One replica to start: its name, port, l2fs node and log file."""

    name: str
    port: int
    node: str
    log_path: Path


@dataclass
class ReplicaInfo:
    """What other commands need to know about one running replica."""

    name: str
    url: str
    node_id: str
    log_path: str
    pid: int | None = None
    bind_url: str = ""      # as the router and other nodes reach it (the node's address with --netns)
    mount: str | None = None  # --mode mount: the node's l2fs mountpoint this replica's LMCache writes to
    lmcache_server: str | None = None  # --lmcache-mode mp: its `lmcache server` (tcp://host:port)
    lmcache_server_log: str | None = None


@dataclass
class StackState:
    """Contents of `<dir>/up.json`."""

    dir: str
    model: str
    l2fs_master: str
    nodes: list[str]
    replicas: list[ReplicaInfo]
    kv_events: list[str]
    router_url: str | None
    strategy: str | None
    pid: int = field(default_factory=os.getpid)
    mode: str = "plugin"                 # plugin (our connector) | mount (stock fs:// on l2fs mounts)
    kv_prefix: str = ""                  # l2fs directory of the KV chunks (under each mount in mount mode)
    mounts: dict[str, str] = field(default_factory=dict)  # node -> mountpoint (mount mode)
    host_l2fs_master: str = ""           # the master as reached from the host (a forwarder with --netns)
    netns: dict[str, Any] | None = None  # NetnsCluster.describe(): prefix, subnet, addresses, rates, forwards
    lmcache_mode: str = "inprocess"      # inprocess (LMCache inside vLLM) | mp (an `lmcache server` per replica)
    mount_servers: dict[str, str] = field(default_factory=dict)  # node -> passthrough | pyfuse3 (mount mode)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> StackState:
        """Read a state file written by a running `kvtier up` (clear error if it is not one)."""
        try:
            raw = json.loads(Path(path).read_text())
            raw["replicas"] = [ReplicaInfo(**r) for r in raw["replicas"]]
            return cls(**raw)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"kvtier: {path} is not a kvtier up state file: {e}") from e


def default_model(base: Path) -> Path:
    """The tiny local model, built on first use (no download)."""
    out = base / "models" / "tiny-llama"
    if not (out / "config.json").exists():
        from kvtier.devstack.tiny_model import build

        log(f"building the tiny local model under {out} (first run only)")
        build(out)
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _last_line(path: Path, width: int = 110) -> str:
    """Last non-empty line of a log (what an engine is doing while it starts)."""
    lines = [ln for ln in procs.tail(path, 20).splitlines() if ln.strip()]
    return _ANSI.sub("", lines[-1])[:width] if lines else "-"


class Stack(procs.Started):
    """l2fs cluster + replicas + router, started in that order and stopped in reverse.

    Use as a context manager; `stop()` is idempotent and safe after a partial start.
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        replicas: int = 2,
        workers: int = 2,
        model: str | None = None,
        strategy: str | None = "prefixaware",
        router_port: int = 0,
        l1_gb: float = 1.0,
        max_model_len: int = 8192,
        parallel_start: bool = True,
        prefix_caching: bool = False,
        kv_cache_gb: float = 2.0,
        mode: str = "plugin",
        netns: bool = False,
        link: str | None = None,
        device: str | None = None,
        tensor_parallel_size: int = 1,
        share_gpus: bool = False,
        replica_env: dict[str, str] | None = None,
        l2fs_shards: int = 1,
        lmcache_mode: str = "inprocess",
        mount_server: str = "auto",
    ) -> None:
        if replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if workers < 1:
            raise ValueError("--workers must be >= 1")
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}")
        if link and not netns:
            raise ValueError("--link needs --netns")
        if mount_server not in MOUNT_SERVERS:
            raise ValueError(f"--mount-server must be one of {', '.join(MOUNT_SERVERS)}")
        self.mount_server = mount_server
        self.mount_servers: dict[str, str] = {}  # node -> the mount it runs (mount mode)
        if lmcache_mode not in LMCACHE_MODES:
            raise ValueError(f"--lmcache-mode must be one of {', '.join(LMCACHE_MODES)}")
        if lmcache_mode == "mp" and (mode != "plugin" or netns or device == "cuda"):
            raise ValueError(MP_ONLY)
        self.lmcache_mode = lmcache_mode
        self.mp_servers: dict[int, Any] = {}  # replica index -> its lmcache server (--lmcache-mode mp)
        if tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        self.mode, self.use_netns, self.link = mode, netns, link
        self.device, self.tp, self.share_gpus = device, tensor_parallel_size, share_gpus
        self.gpu_slots: list[Any] = []  # one GpuSlot (cuda) or None (cpu) per replica
        self.net: Any = None  # the NetnsCluster with --netns
        self.mounts: dict[str, str] = {}
        self.base = Path(base_dir).resolve()
        self.n_replicas = replicas
        self.n_workers = workers
        self.l2fs_shards = l2fs_shards  # path-hash sharded l2fs masters (every role gets the "m0;m1" list)
        self.model_arg = model
        self.strategy = strategy
        self.router_port = router_port
        self.l1_gb = l1_gb
        self.max_model_len = max_model_len
        self.parallel_start = parallel_start
        self.prefix_caching = prefix_caching
        self.kv_cache_gb = kv_cache_gb
        self.replica_env = dict(replica_env or {})  # extra env of every replica (e.g. the load gate's prefill rate)
        self.kv_events: list[str] = []  # ZMQ PUB endpoint per replica (only with L0 prefix caching)
        self.cluster: Any = None
        self.replicas: list[Any] = []
        self.infos: list[ReplicaInfo] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.router_url: str | None = None
        self.model = ""
        self._stopped = False
        self._launched: dict[int, Any] = {}  # replicas started so far (filled by launch threads)
        self._host_share = 1  # replicas sharing this machine's cores, set when they are started
        self._threads: list[threading.Thread] = []

    @property
    def state_path(self) -> Path:
        return self.base / STATE_NAME

    # --- start ---
    def start(self) -> StackState:
        """l2fs, then the replicas (in parallel unless --sequential), then the router; writes up.json."""
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "logs").mkdir(exist_ok=True)
        self.model = self.model_arg or str(default_model(self.base))
        self.gpu_slots = self.plan_gpus()  # too few GPUs fails here, before anything started
        if self.lmcache_mode == "mp" and self.device == "cuda":
            raise ValueError(MP_ONLY)
        nodes = self._start_l2fs()
        plan = self._plan_replicas(nodes)
        self._start_replicas(plan)
        if self.strategy:
            self._start_router()
        from connector.config import DEFAULT_PREFIX
        from kvtier.contract import MP_PREFIX

        state = StackState(dir=str(self.base), model=self.model, l2fs_master=self.cluster.master, nodes=nodes,
                           replicas=self.infos, kv_events=self.kv_events, router_url=self.router_url,
                           strategy=self.strategy, mode=self.mode,
                           kv_prefix=MP_PREFIX if self.lmcache_mode == "mp" else DEFAULT_PREFIX, mounts=self.mounts,
                           host_l2fs_master=self.cluster.host_master,
                           netns=self.net.describe() if self.net is not None else None, lmcache_mode=self.lmcache_mode,
                           mount_servers=self.mount_servers)
        state.save(self.state_path)
        return state

    def _start_l2fs(self) -> list[str]:
        """Master + workers (in their namespaces with --netns), and each node's mount in mount mode; returns the
        node ids (one per worker)."""
        from l2fs.testing.cluster import LocalCluster

        if self.use_netns:
            from l2fs.testing.netns import NetnsCluster

            self.net = NetnsCluster(self.n_workers, link=self.link)
            self.net.__enter__()
            log(f"network namespaces {self.net.prefix}-* (subnet {self.net.subnet}, link {self.link or 'unshaped'})")
        log(f"starting l2fs: master + {self.n_workers} workers (data under {self.base / 'l2fs'})")
        self.cluster = LocalCluster(self.base / "l2fs", workers=self.n_workers, netns=self.net,
                                    shards=self.l2fs_shards)
        self.cluster.__enter__()
        nodes = [w.node_id for w in self.cluster.workers]
        log(f"l2fs master at {self.cluster.master}, nodes {', '.join(nodes)}")
        if self.mode == "mount":
            for i, node in enumerate(nodes):
                self.mount_servers[node] = mount_node(self.cluster, i, self.base / "mnt" / node,
                                                      self.base / "mnt-cache" / node, self.mount_server)
                self.mounts[node] = str(self.base / "mnt" / node)
                log(f"{node}: l2fs mounted at {self.mounts[node]} ({self.mount_servers[node]})")
        return nodes

    def plan_gpus(self, gpus: int | None = None) -> list[Any]:
        """Per replica: its GpuSlot (CUDA_VISIBLE_DEVICES, TP group, memory share) with --device cuda, else
        None. gpus: how many this machine has (default: what torch sees)."""
        from connector.config import detect_device, gpu_count, gpu_plan

        self.device = self.device or detect_device()
        if self.device != "cuda":
            return [None] * self.n_replicas
        return list(gpu_plan(self.n_replicas, self.tp, gpu_count() if gpus is None else gpus,
                             share=self.share_gpus))

    def _plan_replicas(self, nodes: list[str]) -> list[_Planned]:
        """Name, port, node (round-robin over the l2fs nodes) and log of each replica; KV event endpoints."""
        plan = []
        for i in range(self.n_replicas):
            name = f"replica-{i + 1}"
            plan.append(_Planned(name, free_port(), nodes[i % len(nodes)], self.base / "logs" / f"{name}.log"))
            if self.prefix_caching:  # vLLM emits KV events only for prefix-cached blocks
                self.kv_events.append(f"tcp://{self._node_addr(plan[-1].node)}:{free_port()}")
        return plan

    def _node_addr(self, node: str) -> str:
        """The address a node's processes bind (127.0.0.1 on loopback)."""
        return self.net.ns(node).addr if self.net is not None else "127.0.0.1"

    def _launch(self, i: int, p: _Planned, errors: list[BaseException]) -> None:
        """Thread body: start replica i; a failure is collected, reported once all launches returned."""
        from kvtier.devstack.replica import start_replica

        gpu = self.gpu_slots[i] if self.gpu_slots else None
        engine = f"vLLM CUDA engine on GPU {','.join(map(str, gpu.devices))}" if gpu else "vLLM CPU engine, ~1 min"
        log(f"starting {p.name} on {p.node}, port {p.port} ({engine}; log {p.log_path})")
        extra = ["--enable-prompt-tokens-details"]  # usage.cached_tokens: per-request hit evidence
        if self.kv_events:
            extra += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.kv_events[i]})]
        where: dict[str, Any] = {}
        if self.net is not None:  # bound to the node's address, in its namespace, reached via a forwarder
            fwd = self.net.forward(p.port, where=p.node)
            where = {"bind_host": self._node_addr(p.node), "reach": ("127.0.0.1", fwd.port),
                     "wrap": lambda argv: self.net.wrap(p.node, argv)}
        l2: dict[str, Any] = {"mount_path": self.mounts[p.node]} if self.mode == "mount" \
            else {"l2fs_master": self.cluster.master}
        env = dict(self.replica_env)
        try:
            if self.lmcache_mode == "mp":  # its own server on its node, like the webhook's sidecar
                from kvtier.devstack.mp_server import mp_transfer_config, start_mp_server

                srv = start_mp_server(self.cluster.master, p.node, p.log_path.with_name(f"{p.name}-lmcache-server.log"),
                                      l1_gb=self.l1_gb)
                self.mp_servers[i] = srv
                log(f"{p.name}: lmcache server (MP mode) on 127.0.0.1:{srv.port}; log {srv.log_path}")
                extra += ["--kv-transfer-config", json.dumps(mp_transfer_config(srv.port))]
                l2 = {"lmcache": False}
                env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # a KV connector's thread needs a core
            self._launched[i] = start_replica(
                self.model, p.port, node_id=p.node, l1_gb=self.l1_gb,
                log_path=p.log_path, max_model_len=self.max_model_len, prefix_caching=self.prefix_caching,
                kv_cache_gb=self.kv_cache_gb, extra_args=extra, config_dir=self.base / "config", progress=False,
                extra_env=env,
                device=self.device or "cpu", gpu=self.gpu_slots[i] if self.gpu_slots else None,
                host_share=self._host_share, **l2, **where)
            log(f"{p.name} healthy at {self._launched[i].url}")
        except BaseException as e:  # noqa: BLE001 - reported after all launches returned
            errors.append(e)

    def _start_replicas(self, plan: list[_Planned]) -> None:
        """Launch every replica in its own thread and report progress until all are healthy (or one failed)."""
        errors: list[BaseException] = []
        self._host_share = len(plan)  # every replica runs on this machine's cores (namespace nodes too)
        threads = [threading.Thread(target=self._launch, args=(i, p, errors), daemon=True)
                   for i, p in enumerate(plan)]
        self._threads = threads
        t0 = time.monotonic()
        for th in threads:
            th.start()
            if not self.parallel_start:
                th.join()
        while any(th.is_alive() for th in threads):
            for th in threads:
                th.join(timeout=10)
            if any(th.is_alive() for th in threads):
                log(f"waiting for engines ({time.monotonic() - t0:.0f}s, {len(self._launched)}/{len(plan)} up)")
                for i, p in enumerate(plan):
                    if i not in self._launched:
                        log(f"  {p.name}: {_last_line(p.log_path)}")
        self.replicas = [self._launched[i] for i in sorted(self._launched)]
        if errors:
            raise RuntimeError(f"replica start failed: {errors[0]!r}") from errors[0]
        for i, p in enumerate(plan):
            rep, srv = self._launched[i], self.mp_servers.get(i)
            self.infos.append(ReplicaInfo(p.name, rep.url, p.node, str(p.log_path), rep.proc.pid,
                                          bind_url=rep.bind_url, mount=self.mounts.get(p.node),
                                          lmcache_server=f"tcp://127.0.0.1:{srv.port}" if srv else None,
                                          lmcache_server_log=str(srv.log_path) if srv else None))

    def _start_router(self) -> None:
        port = self.router_port or free_port()
        urls = ",".join(r.bind_url or r.url for r in self.infos)
        host = self.net.ctl.addr if self.net is not None else "127.0.0.1"
        # MP mode's chunk keys are the server's blake3 ObjectKeys, which the router's L2 lookup does not compute
        l2 = None if self.lmcache_mode == "mp" else self.cluster.master
        cmd = router_command(urls, str(self.strategy), port, self.model, l2, self.kv_events, host=host)
        log_path = self.base / "logs" / "router.log"
        log(f"starting router ({self.strategy}) on {host}:{port}; log {log_path}")
        if self.net is not None:  # in the control namespace; the host reaches it on 127.0.0.1:<--port or free>
            self.router = procs.spawn(self.net.wrap("ctl", cmd), log_path, die_with_parent=True)
            fwd = self.net.forward(port, where="ctl", listen_port=self.router_port)
            self.router_url = f"http://{fwd.address}"
        else:
            self.router = procs.spawn(cmd, log_path, die_with_parent=True)
            self.router_url = f"http://127.0.0.1:{port}"
        procs.wait_ready(self.router, lambda: procs.http_ok(f"{self.router_url}/health"), timeout=300,
                         what="router", log_path=log_path, interval=0.5)
        log(f"router healthy at {self.router_url}")

    # --- stop ---
    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.router is not None:
            log("stopping router")
            procs.stop(self.router)
        if any(th.is_alive() for th in self._threads):
            # Interrupted while engines start: let the launches finish, so that none is left behind.
            log("waiting for engines that are still starting, to stop them")
            for th in self._threads:
                th.join()
        for i in sorted(self._launched):
            rep = self._launched[i]
            log(f"stopping replica-{i + 1}")
            try:
                rep.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the rest
                log(f"error stopping replica: {e!r}")
        for i in sorted(self.mp_servers):
            log(f"stopping replica-{i + 1}'s lmcache server")
            self.mp_servers[i].stop()
        if self.cluster is not None:
            log("stopping l2fs")
            self.cluster.__exit__(None, None, None)
        if self.net is not None:
            log(f"removing network namespaces {self.net.prefix}-*")
            self.net.close()
        try:
            self.state_path.unlink()
        except OSError:
            pass
        log("all stopped")



def router_command(urls: str, strategy: str, port: int, model: str, l2fs_master: str | None,
                   kv_events: list[str], host: str = "127.0.0.1") -> list[str]:
    """`kvtier router` for this stack: the model's own tokenizer, vLLM CPU's 128-token blocks, L2 presence."""
    cmd = [sys.executable, "-m", "kvtier.cli", "router", "--replicas", urls, "--strategy", strategy,
           "--port", str(port), "--host", host, "--tokenizer", model, "--block-size", "128"]
    if l2fs_master and importlib.util.find_spec("router.l2") is not None:  # router's optional L2 lookup
        cmd += ["--l2fs-master", l2fs_master]
    if kv_events:
        cmd += ["--kv-events", ",".join(kv_events)]
    return cmd


def chat_once(base_url: str, model: str, text: str = "Hello! Say something.", max_tokens: int = 16,
              timeout: float = 120.0) -> dict[str, Any]:
    """One chat completion (used by --smoke and the tests)."""
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=timeout, json={
        "model": model, "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


def _print_endpoints(state: StackState, smoke: bool = False) -> None:
    print("kvtier is up:")
    print(f"  router ({state.strategy}): {state.router_url}")
    for r in state.replicas:
        print(f"  {r.name} ({r.node_id}): {r.url}   log {r.log_path}")
    print(f"  l2fs master: {state.l2fs_master}   nodes: {', '.join(state.nodes)}   mode: {state.mode}"
          f"   lmcache: {state.lmcache_mode}")
    for r in state.replicas:
        if r.lmcache_server:
            print(f"  {r.name} lmcache server: {r.lmcache_server}   log {r.lmcache_server_log}")
    for node, mp in state.mounts.items():
        print(f"  {node} l2fs mount: {mp} ({state.mount_servers.get(node, 'pyfuse3')})")
    if state.netns:
        print(f"  namespaces: {state.netns['prefix']}-* subnet {state.netns['subnet']}; from the host: master "
              f"{state.host_l2fs_master}, router {state.router_url}")
    print(f"  state file: {Path(state.dir) / STATE_NAME}")
    target = state.router_url or state.replicas[0].url
    body = json.dumps({"model": state.model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 16})
    print("try:")
    print(f"  curl -s {target}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    print("smoke test: one request, then stop." if smoke else "Ctrl-C stops everything.", flush=True)


def _passthrough_works(cluster: Any, i: int, log_path: Path, since: int) -> str | None:
    """None when node i's passthrough mount serves its opens through the kernel, else why not. A probe, not a
    version check: the server logs whether INIT granted FUSE_PASSTHROUGH, and a write through the mount (a
    writer always registers its backing file) makes it try FUSE_DEV_IOC_BACKING_OPEN, which it logs if refused."""
    def text() -> str:
        with open(log_path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    deadline = time.monotonic() + 10
    while "FUSE protocol 7." not in text():
        if time.monotonic() > deadline:
            return "the mount logged no INIT"
        time.sleep(0.05)
    if "passthrough off" in text():
        return "the kernel did not grant FUSE_PASSTHROUGH at INIT (needs Linux >= 6.9, CONFIG_FUSE_PASSTHROUGH)"
    mp = cluster.mounts[i][0]
    probe = Path(mp) / f".kvtier-passthrough-probe-{cluster.workers[i].node_id}"
    try:
        probe.write_bytes(b"probe")
        ok = probe.read_bytes() == b"probe"
        probe.unlink()
    except OSError as e:
        return f"a probe write through the mount failed: {e}"
    if "FUSE_DEV_IOC_BACKING_OPEN refused" in text():
        return "the kernel refused FUSE_DEV_IOC_BACKING_OPEN"
    return None if ok else "the probe file read back different bytes"


def mount_node(cluster: Any, i: int, mountpoint: Path, cache_dir: Path, server: str, *extra: str) -> str:
    """Mount the cluster at mountpoint as node i: the read-write passthrough mount where the kernel grants it
    (server auto, probed), else the pyfuse3 mount; `server` passthrough|pyfuse3 forces one (passthrough fails
    with the probe's reason where it does not work). Returns the one it runs."""
    if server in ("auto", "passthrough"):
        cache_dir.mkdir(parents=True, exist_ok=True)  # the open writers' temp files and cross-node copies
        log_path = cluster.base / "logs" / f"mount-{i + 1}.log"
        since = log_path.stat().st_size if log_path.exists() else 0
        cluster.mount(i, mountpoint, "--passthrough", "--cache-dir", str(cache_dir), *extra)
        why = _passthrough_works(cluster, i, log_path, since)
        if why is None:
            return "passthrough"
        cluster.unmount(i)
        if server == "passthrough":
            raise RuntimeError(f"--mount-server passthrough: {why}")
        log(f"node {cluster.workers[i].node_id}: no passthrough mount ({why}); the pyfuse3 mount instead")
    cluster.mount(i, mountpoint)
    return "pyfuse3"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier up", description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="data, models and logs (default ./.kvtier)")
    p.add_argument("--replicas", type=int, default=2, help="vLLM CPU replicas (default 2)")
    p.add_argument("--workers", type=int, default=2, help="l2fs workers = nodes (default 2)")
    p.add_argument("--l2fs-shards", type=int, default=1,
                   help="l2fs masters, the namespace sharded by path hash (default 1; docs/l2fs.md)")
    p.add_argument("--model", default=None, help="model path or name (default: tiny local model, built once)")
    p.add_argument("--port", type=int, default=8080, help="router port (0 = any free port)")
    p.add_argument("--strategy", default="prefixaware",
                   help="router strategy: roundrobin|session|prefixaware|kvaware (default prefixaware)")
    p.add_argument("--l1-gb", type=float, default=1.0, help="LMCache L1 (host memory) per replica, GB")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--prefix-caching", action="store_true",
                   help="also keep vLLM's own prefix cache (L0) on; enables KV events for the router's kvaware")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="vLLM CPU KV cache (L0) per replica, GB")
    p.add_argument("--sequential", action="store_true", help="start engines one after another")
    p.add_argument("--smoke", action="store_true", help="send one request through the router, then stop")
    p.add_argument("--mode", choices=MODES, default="plugin",
                   help="plugin: LMCache + our l2fs connector (default); mount: each node's own `l2fs mount` "
                   "and stock LMCache fs:// on it")
    p.add_argument("--mount-server", choices=MOUNT_SERVERS, default="auto",
                   help="--mode mount: passthrough: the read-write FUSE passthrough mount (`l2fs mount --passthrough`, "
                   "Linux >= 6.9); pyfuse3: the pyfuse3 mount; auto (default): passthrough where a probe shows the "
                   "kernel grants it, pyfuse3 otherwise")
    p.add_argument("--lmcache-mode", choices=LMCACHE_MODES, default="inprocess",
                   help="inprocess: LMCache inside vLLM (default); mp: LMCache multiprocess mode, an `lmcache server` "
                   "per replica with kvtier's l2fs adapter and vLLM on LMCache's MP connector")
    p.add_argument("--netns", action="store_true",
                   help="one network namespace per node (needs root, ip, tc, nsenter); router on 127.0.0.1:--port")
    p.add_argument("--link", default=None, metavar="RATE", help="with --netns: each node's link rate, e.g. 2gbit")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: GPU replicas (no CPU-only flags, GPUs assigned per replica); auto: cuda if torch sees one")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per replica with --device cuda")
    p.add_argument("--share-gpus", action="store_true",
                   help="--device cuda: more replicas than GPU groups share them (memory utilization split)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=None, metavar="N",
                   help="the engines' prefill rate (tokens/s): L2 hits are claimed only while loading them beats "
                   "recomputing them (plugin mode; connector.loadgate); default: gate off")
    p.add_argument("--cleanup", action="store_true",
                   help="remove namespaces, mounts and processes left by crashed --netns launchers, then exit")
    return p


def prefill_env(tokens_per_s: float | None) -> dict[str, str]:
    """The replicas' env for the load gate's prefill figure (none = the gate stays off)."""
    from connector.config import PREFILL_ENV

    return {PREFILL_ENV: f"{tokens_per_s:g}"} if tokens_per_s else {}


def check_args(args: argparse.Namespace) -> str | None:
    """A clear message for bad options, before anything starts."""
    from router.policy import STRATEGIES

    if args.replicas < 1 or args.workers < 1:
        return "--replicas and --workers must be >= 1"
    if args.l2fs_shards < 1:
        return "--l2fs-shards must be >= 1"
    if args.strategy not in STRATEGIES:
        return f"unknown --strategy {args.strategy!r}; choose one of {', '.join(STRATEGIES)}"
    if not 0 <= args.port <= 65535:
        return f"--port {args.port} is not a TCP port"
    if args.model and (args.model.startswith((".", "/")) or os.sep in args.model) and not Path(args.model).exists():
        return f"--model {args.model}: no such directory"
    if args.l1_gb <= 0 or args.kv_cache_gb <= 0:
        return "--l1-gb and --kv-cache-gb must be > 0"
    if args.link and not args.netns:
        return "--link needs --netns (loopback has no link to shape)"
    if args.lmcache_mode == "mp" and (args.mode != "plugin" or args.netns or args.device == "cuda"):
        return MP_ONLY
    if args.mount_server != "auto" and args.mode != "mount":
        return f"--mount-server {args.mount_server} needs --mode mount"
    if args.lmcache_mode == "mp" and args.prefill_tokens_per_s is not None:
        return ("--prefill-tokens-per-s feeds the in-process plugin's load gate; in MP mode the gate's figure is "
                "the L2 adapter's prefill_tokens_per_s")
    if args.prefill_tokens_per_s is not None and (args.prefill_tokens_per_s < 0 or args.mode != "plugin"):
        return "--prefill-tokens-per-s: a rate >= 0, in plugin mode (the load gate is in the l2fs plugin)"
    if args.tensor_parallel_size < 1:
        return "--tensor-parallel-size must be >= 1"
    if args.device == "cuda":
        from connector.config import gpu_count, gpu_plan

        try:
            gpu_plan(args.replicas, args.tensor_parallel_size, gpu_count(), share=args.share_gpus)
        except ValueError as e:
            return f"--device cuda: {e}"
    if args.netns:
        from l2fs.testing.netns import NetnsError, check_host, parse_rate

        try:
            check_host()
            if args.link:
                parse_rate(args.link)
        except (NetnsError, ValueError) as e:
            return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cleanup:
        from l2fs.testing.cluster import cleanup_leftovers

        return cleanup_leftovers("kvtier up")
    problem = check_args(args)
    if problem:
        print(f"kvtier up: {problem}", file=sys.stderr)
        return 2
    stop_event = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log(f"got signal {signum}; shutting down")
        stop_event.set()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(args.dir, replicas=args.replicas, workers=args.workers, model=args.model,
                  strategy=args.strategy, router_port=args.port, l1_gb=args.l1_gb,
                  max_model_len=args.max_model_len, parallel_start=not args.sequential,
                  prefix_caching=args.prefix_caching, kv_cache_gb=args.kv_cache_gb, mode=args.mode,
                  lmcache_mode=args.lmcache_mode, mount_server=args.mount_server,
                  netns=args.netns, link=args.link, device=None if args.device == "auto" else args.device,
                  tensor_parallel_size=args.tensor_parallel_size, share_gpus=args.share_gpus,
                  replica_env=prefill_env(args.prefill_tokens_per_s), l2fs_shards=args.l2fs_shards)
    rc = 0
    try:
        state = stack.start()
        _print_endpoints(state, smoke=args.smoke)
        if args.smoke:
            reply = chat_once(state.router_url or state.replicas[0].url, state.model)
            text = reply["choices"][0]["message"]["content"]
            print(f"smoke: OK, {reply['usage']['completion_tokens']} tokens: {text!r}", flush=True)
        else:
            def on_stop(signum: int, _frame: object) -> None:
                log(f"got signal {signum}; shutting down")
                stop_event.set()

            signal.signal(signal.SIGINT, on_stop)
            signal.signal(signal.SIGTERM, on_stop)
            while not stop_event.wait(1.0):
                if stack.router is not None and stack.router.poll() is not None:
                    log(f"router exited (rc={stack.router.returncode}); shutting down")
                    rc = 1
                    break
    except KeyboardInterrupt:
        pass
    except Exception as e:  # noqa: BLE001 - any failure here is reported, never fatal
        log(f"error: {e}")
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return rc


if __name__ == "__main__":
    sys.exit(main())
