"""`kvtier router ...`: start the cache-aware OpenAI-compatible router."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from kvtier import contract
from kvtier import envs as kvtier_envs
from kvtier.contract import STRATEGIES
from router.tokens import INLINE_BYTES

if TYPE_CHECKING:
    from router.l2 import L2Lookup

# --l2fs-mode of replicas on LMCache's multiprocess server (operator-patch --mode mp, kvtier up --lmcache-mode mp):
# their L2 objects are named by the server's blake3 ObjectKeys, which the router's L2 lookup does not compute
MP_MODE = "mp"


def _split(v: str | None) -> list[str]:
    return [x.strip() for x in v.split(",")] if v else []


def parse_tier_cost(v: str) -> tuple[dict[str, float], bool]:
    """'L1=0.2,L2=0.5' -> ({'L1': 0.2, 'L2': 0.5}, False); tiers L1/L2 only, each in [0, 1]. 'L2=auto' (or
    'L2=auto:0.4', the value used until the first fit) -> calibrated from measured prefill times: True."""
    out: dict[str, float] = {}
    auto = False
    for item in _split(v):
        tier, sep, num = item.partition("=")
        if not sep or tier.upper() not in ("L1", "L2"):
            raise ValueError(f"{item!r}: expected L1=<cost> or L2=<cost>|auto[:start]")
        if tier.upper() == "L2" and (num.lower() == "auto" or num.lower().startswith("auto:")):
            auto = True
            num = num[5:] if num[4:5] == ":" else "0.5"
        try:
            cost = float(num)
        except ValueError:
            raise ValueError(f"{item!r}: cost is not a number") from None
        if not 0.0 <= cost <= 1.0:
            raise ValueError(f"{item!r}: cost must be in [0, 1] (recomputing a token costs 1)")
        out[tier.upper()] = cost
    return out, auto


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier router", description=__doc__)
    p.add_argument("--replicas", default=kvtier_envs.get("KVTIER_REPLICAS"),
                   help="comma-separated replica base URLs (http://host:8000,...)")
    p.add_argument("--strategy", default=contract.DEFAULT_STRATEGY, help=f"default strategy: {', '.join(STRATEGIES)} "
                   "(per request: header X-Kvtier-Strategy)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed on stdout)")
    p.add_argument("--tokenizer", default="replica",
                   help="model path / hub id for AutoTokenizer + chat template; 'replica' (default, and the "
                        "fallback when the path cannot be loaded) asks a replica's vLLM /tokenize; "
                        "'bytes' = UTF-8 bytes (tests only)")
    p.add_argument("--tokenize-inline-bytes", type=int, default=INLINE_BYTES,
                   help="request bodies up to this size are tokenized on the event loop, larger ones in a thread "
                   "pool (0 = always the pool)")
    p.add_argument("--block-size", type=int, default=16, help="engine KV block size in tokens")
    p.add_argument("--kv-events", default="", help="comma-separated ZMQ PUB endpoints, one per replica "
                   "(tcp://host:5557); empty entries allowed")
    p.add_argument("--kv-replay", default="", help="comma-separated ZMQ replay (ROUTER) endpoints, one per replica")
    p.add_argument("--api-key", default=kvtier_envs.get("KVTIER_ROUTER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' from clients (env KVTIER_ROUTER_API_KEY)")
    p.add_argument("--tls-cert", default=kvtier_envs.get("KVTIER_ROUTER_TLS_CERT"),
                   help="serve HTTPS with this PEM certificate (chain); needs --tls-key. Plain HTTP is then refused")
    p.add_argument("--tls-key", default=kvtier_envs.get("KVTIER_ROUTER_TLS_KEY"),
                   help="PEM private key of --tls-cert")
    p.add_argument("--upstream-api-key", default=kvtier_envs.get("KVTIER_UPSTREAM_API_KEY"),
                   help="bearer token sent to replicas (vLLM --api-key)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--health-timeout", type=float, default=1.0)
    p.add_argument("--load-scrape-interval", type=float, default=1.0,
                   help="seconds between reads of each replica's /metrics (vllm:num_requests_running/waiting), so "
                        "load other routers sent counts in routing; 0 = only this router's own in-flight counts")
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="seconds to wait for a replica's first byte (and between bytes)")
    p.add_argument("--keep-alive-timeout", type=float, default=75.0,
                   help="seconds an idle client connection stays open. Longer than any client's or load "
                        "balancer's own idle timeout (httpx 5 s, AWS ALB 60 s), so the client always closes "
                        "first: a server closing at the moment the client reuses the connection loses that "
                        "request ('Server disconnected without sending a response'); uvicorn's default is 5 s")
    p.add_argument("--retries", type=int, default=2, help="other replicas to try before the first byte")
    p.add_argument("--load-epsilon", type=float, default=0.25, help="no replica above (1+e) x mean in-flight")
    p.add_argument("--decode-beta", type=float, default=0.1, help="cost weight of active decode context tokens")
    p.add_argument("--request-cost", type=float, default=0.0,
                   help="cost of each request in flight on a replica, in prompt tokens (whatever its length)")
    p.add_argument("--tier-cost", default="L1=0.2,L2=0.5",
                   help="routing cost of one cached token by tier, relative to recomputing it (1); L0 is free. "
                        "L1 = blocks the replica's KV events place on CPU, L2 = chunks only in l2fs; L2=auto[:start] "
                        "fits it from streamed requests' prefill times (docs/router.md)")
    p.add_argument("--session-header", default="x-session-id")
    p.add_argument("--prefix-affinity", action="store_true",
                   default=kvtier_envs.get("KVTIER_ROUTER_PREFIX_AFFINITY") not in ("", "0", "false"),
                   help="a prefix no replica is known to hold goes to the rendezvous-hash home of its first "
                        "block (not the least loaded), so several router processes agree without sharing state "
                        "(env KVTIER_ROUTER_PREFIX_AFFINITY)")
    p.add_argument("--max-inflight", type=int, default=1024,
                   help="requests in the router at once, all replicas together (0 = only the per-replica bound)")
    p.add_argument("--max-inflight-per-replica", type=int, default=256,
                   help="requests in flight to one replica (0 = unbounded; vLLM's default max_num_seqs is 256)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot; beyond it an immediate 429 with Retry-After")
    p.add_argument("--queue-timeout", type=float, default=2.0,
                   help="seconds a request may wait for a slot before its 429")
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds sent with 429/503 rejects")
    p.add_argument("--k8s-selector", default=None, help="discover replicas: pods matching this label selector")
    p.add_argument("--k8s-namespace", default="default")
    p.add_argument("--k8s-port", default="8000", help="replica HTTP port: a number or a named container port")
    p.add_argument("--k8s-kv-events-port", default=None, help="KV events PUB port (number or port name)")
    p.add_argument("--k8s-kv-replay-port", default=None, help="KV events replay port (number or port name)")
    p.add_argument("--k8s-api", default=None, help="API server URL (default: in-cluster config, then kubeconfig)")
    from l2fs.options import add_client_args

    # the l2fs client flags every l2fs caller shares, as --l2fs-*: master (kvaware L2 presence), token, TLS CA
    add_client_args(p, prefix="l2fs-", timeout=None, help={
        "master": "host:port of the l2fs master: kvaware's L2 presence lookups ($L2FS_MASTER; none: off)",
        "token": "l2fs bearer token, a router-role one reads only ($L2FS_TOKEN)"})
    p.add_argument("--l2fs-mode", default="plugin", choices=(*contract.L2_MODES, MP_MODE),
                   help="how the replicas write L2 chunks: plugin (connector.lmcache_l2fs) or mount "
                        "(LMCache fs:// on an l2fs mount); decides the file names looked up. mp (LMCache's "
                        "multiprocess server, the webhook's --mode mp): no L2 lookup, whatever --l2fs-master says "
                        "(the server's keys are its blake3 ObjectKeys, not the chunk hashes computed here); "
                        "routing by KV events and load only")
    p.add_argument("--l2fs-prefix", default=contract.KV_PREFIX,
                   help="l2fs directory the replicas write chunks under")
    p.add_argument("--l2fs-timeout", type=float, default=0.05,
                   help="seconds an L2 presence lookup may take before it counts as a miss")
    p.add_argument("--l2fs-min-tokens", type=int, default=0,
                   help="no L2 lookup for a prompt shorter than this many tokens (kvaware then routes it by L0/L1 "
                   "and load); 0 = look up every prompt")
    p.add_argument("--l2fs-lookup", choices=("needed", "always"), default="needed",
                   help="needed: look up L2 only when some answer could change kvaware's pick (no L0/L1 hit "
                   "anywhere, or the cheapest replica ahead by more than any L2 hit could give another, is "
                   "routed at once; such requests carry no L2 prediction in the accounting); always: every "
                   "request. --tier-cost L2=auto always looks")
    p.add_argument("--l2fs-chunk-size", type=int, default=contract.CHUNK_SIZE, help="LMCache chunk size in tokens")
    p.add_argument("--l2fs-model-name", default=None,
                   help="model name in LMCache keys (the replicas' --model; default: the request's model)")
    p.add_argument("--l2fs-dtype", default="float", help="LMCache dtype string of the KV (float, half, bfloat16)")
    p.add_argument("--l2fs-hash-seed", default=contract.HASH_SEED,
                   help="the replicas' PYTHONHASHSEED (LMCache's builtin chunk hash depends on it)")
    p.add_argument("--l2fs-key-records-interval", type=float, default=60.0,
                   help="seconds between reads of the engines' key-check records in l2fs (an engine whose "
                        "LMCache hashes otherwise turns L2 credit off; 0: not read)")
    p.add_argument("--workers", type=int, default=int(kvtier_envs.get("KVTIER_ROUTER_WORKERS") or 1),
                   help="router processes sharing the port (SO_REUSEPORT; the kernel spreads connections); each "
                        "is a full router with its own state: use --prefix-affinity and --load-scrape-interval so "
                        "they agree; admission bounds are per process; /metrics merges all workers (label worker). "
                        "Env KVTIER_ROUTER_WORKERS")
    p.add_argument("--worker-of", default=None, help=argparse.SUPPRESS)  # internal: "<peers dir>:<worker id>"
    p.add_argument("--loop", choices=("asyncio", "uvloop", "auto"), default="asyncio",
                   help="event loop: asyncio's own (default: what the kvtier image has; uvloop measured no faster "
                        "here once connections had TCP_NODELAY), uvloop, or auto (uvloop where installed)")
    p.add_argument("--data-path", choices=("python", "haproxy"),
                   default=kvtier_envs.get("KVTIER_ROUTER_DATA_PATH") or "python",
                   help="who carries the requests: this process (python, default), or a haproxy child it starts "
                        "(haproxy: the router only picks each replica, over SPOP; router/haproxy.py and "
                        "docs/router.md say what differs). Env KVTIER_ROUTER_DATA_PATH")
    p.add_argument("--haproxy-bin", default="haproxy", help="--data-path haproxy: the haproxy binary (>= 2.6)")
    p.add_argument("--haproxy-threads", type=int, default=1, help="--data-path haproxy: haproxy's nbthread")
    p.add_argument("--haproxy-body-bytes", type=int, default=None,
                   help="--data-path haproxy: bodies up to this size (default 48 KiB) go through haproxy (its "
                        "buffers are this "
                        "+ 16 KiB, per stream); larger ones, and any without Content-Length, take the Python path")
    p.add_argument("--log-level", default="info")
    return p


def _supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """--workers N: N `router.cli` processes, each with its own SO_REUSEPORT listening socket on one port.

    Separate processes rather than uvicorn's workers=: each must run the router's startup (replica set, KV
    event subscribers, load scrapes) in its own loop, and the parent must keep the port while they come
    and go. The parent holds the port with a bound, never listening socket (so port 0 resolves once), waits
    until every worker listens, prints one URL, restarts a worker that dies, and on SIGTERM/SIGINT stops all.
    Each worker gets its own session: with the kernel's sched_autogroup (on by default on many hosts) a session is
    one CPU share, so N workers in the supervisor's session would split one share and run no faster than one
    process. A worker still stops with the supervisor (it terminates them; PDEATHSIG if it is killed)."""
    import shutil
    import signal
    import subprocess
    import tempfile
    import threading
    import time
    from pathlib import Path

    # preexec_fn: a worker gets SIGTERM if this supervisor dies without stopping it
    from l2fs.procs import _die_with_parent

    hold = _tcp_socket(args.host)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    hold.bind((args.host, args.port))
    port = hold.getsockname()[1]
    peers = tempfile.mkdtemp(prefix="kvtier-router-workers-")
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x))
    log = logging.getLogger("kvtier.router")

    def spawn(i: int) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "router.cli", *argv, "--port", str(port),
                                 "--worker-of", f"{peers}:{i}"], stdout=subprocess.PIPE, text=True, env=env,
                                preexec_fn=_die_with_parent, start_new_session=True)

    def ready(i: int, p: subprocess.Popen[str]) -> subprocess.Popen[str] | None:
        """p once it printed its "listening on" line (then its stdout is passed on), None if it failed."""
        assert p.stdout is not None
        if "listening on" not in p.stdout.readline():
            p.wait()
            print(f"kvtier router: worker {i} failed to start (exit {p.returncode})", file=sys.stderr)
            return None
        threading.Thread(target=lambda: [sys.stdout.write(x) for x in p.stdout or ()], daemon=True).start()
        return p

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    workers: list[subprocess.Popen[str] | None] = []
    try:
        workers = [spawn(i) for i in range(args.workers)]  # started together, then each waited for
        if any(ready(i, w) is None for i, w in enumerate(workers) if w is not None):
            return 1
        scheme = "https" if args.tls_cert else "http"
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"kvtier router listening on {scheme}://{host}:{port} strategy={args.strategy} "
              f"workers={args.workers}", flush=True)
        while not stop.wait(0.5):
            for i, w in enumerate(workers):
                if w is not None and w.poll() is None:
                    continue
                if w is not None:
                    log.warning("router worker %d (pid %d) exited with %s; restarting", i, w.pid, w.returncode)
                    time.sleep(1.0)
                workers[i] = ready(i, spawn(i))
        return 0
    finally:
        for w in workers:
            if w is not None and w.poll() is None:
                w.terminate()
        deadline = time.monotonic() + 10
        for w in workers:
            if w is not None:
                try:
                    w.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait()
        shutil.rmtree(peers, ignore_errors=True)
        hold.close()


def l2_lookup_from_args(args: argparse.Namespace) -> L2Lookup | None:
    """kvaware's L2 presence lookup from the --l2fs-* flags (the shared l2fs client group plus the router's
    own mode, prefix, key settings), or None without a master or in mp mode; ValueError on a bad setting."""
    if not args.l2fs_master or args.l2fs_mode == MP_MODE:
        return None
    from l2fs.options import ClientOptions
    from router.l2 import L2Lookup

    return L2Lookup(args.l2fs_master, mode=args.l2fs_mode, prefix=args.l2fs_prefix, chunk_size=args.l2fs_chunk_size,
                    hash_seed=args.l2fs_hash_seed, model_name=args.l2fs_model_name, dtype=args.l2fs_dtype,
                    client_options=ClientOptions.from_args(args, prefix="l2fs-"),
                    key_records_interval=args.l2fs_key_records_interval)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.strategy not in STRATEGIES:
        print(f"kvtier router: unknown strategy {args.strategy!r}; choose one of {', '.join(STRATEGIES)}",
              file=sys.stderr)
        return 2
    replicas = _split(args.replicas)
    if not replicas and not args.k8s_selector:
        print("kvtier router: give --replicas or --k8s-selector", file=sys.stderr)
        return 2
    for u in replicas:
        if not u.startswith(("http://", "https://")):
            print(f"kvtier router: replica {u!r} is not an http(s) URL", file=sys.stderr)
            return 2
    if bool(args.tls_cert) != bool(args.tls_key):
        print("kvtier router: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    for f in (args.tls_cert, args.tls_key):
        if f and not os.path.isfile(f):
            print(f"kvtier router: TLS file {f!r} not found", file=sys.stderr)
            return 2
    if args.workers < 1:
        print("kvtier router: --workers must be >= 1", file=sys.stderr)
        return 2
    haproxy_bin = None
    if args.data_path == "haproxy":
        from router.haproxy import find_haproxy

        if args.workers > 1:
            print("kvtier router: --data-path haproxy runs one router process (haproxy carries the load); "
                  "--workers must be 1", file=sys.stderr)
            return 2
        if (haproxy_bin := find_haproxy(args.haproxy_bin)) is None:
            print(f"kvtier router: --data-path haproxy: no haproxy binary {args.haproxy_bin!r} "
                  "(apt install haproxy)", file=sys.stderr)
            return 2
        if not 1 <= args.haproxy_threads <= 64:
            print("kvtier router: --haproxy-threads must be in 1..64", file=sys.stderr)
            return 2
        if args.haproxy_body_bytes is not None and not 1024 <= args.haproxy_body_bytes <= 64 << 20:
            print("kvtier router: --haproxy-body-bytes must be in 1 KiB..64 MiB", file=sys.stderr)
            return 2
    if args.workers > 1 and args.worker_of is None:
        return _supervise(args, list(sys.argv[1:] if argv is None else argv))
    for flag in ("max_inflight", "max_inflight_per_replica", "max_queue", "queue_timeout", "load_scrape_interval",
                 "load_epsilon", "decode_beta", "request_cost", "l2fs_min_tokens", "tokenize_inline_bytes",
                 "keep_alive_timeout"):
        if getattr(args, flag) < 0:
            print(f"kvtier router: --{flag.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    try:
        tier_cost, calibrate_l2 = parse_tier_cost(args.tier_cost)
    except ValueError as e:
        print(f"kvtier router: --tier-cost: {e}", file=sys.stderr)
        return 2
    kv = _split(args.kv_events)
    if kv and len(kv) != len(replicas):
        print("kvtier router: --kv-events needs one entry per replica", file=sys.stderr)
        return 2

    import uvicorn

    from router.admission import AdmissionConfig
    from router.app import FastFront, RouterConfig, create_app

    discovery = None
    if args.k8s_selector:
        from router.discovery import K8sDiscovery

        discovery = K8sDiscovery(args.k8s_namespace, args.k8s_selector, port=args.k8s_port,
                                 kv_events_port=args.k8s_kv_events_port, kv_replay_port=args.k8s_kv_replay_port,
                                 api_url=args.k8s_api)
    try:
        l2_lookup = l2_lookup_from_args(args)
    except ValueError as e:
        print(f"kvtier router: {e}", file=sys.stderr)
        return 2
    cfg = RouterConfig(
        replicas=replicas, strategy=args.strategy, tokenizer=args.tokenizer, block_size=args.block_size,
        api_key=args.api_key, upstream_api_key=args.upstream_api_key, max_body_bytes=args.max_body_bytes,
        health_interval=args.health_interval, health_timeout=args.health_timeout,
        load_scrape_interval=args.load_scrape_interval,
        connect_timeout=args.connect_timeout, upstream_timeout=args.upstream_timeout, retries=args.retries,
        load_epsilon=args.load_epsilon, decode_beta=args.decode_beta,
        request_cost=args.request_cost, tokenize_inline_bytes=args.tokenize_inline_bytes, tier_cost=tier_cost, calibrate_l2=calibrate_l2,
        prefix_affinity=args.prefix_affinity, session_header=args.session_header.lower(),
        kv_endpoints=[x or None for x in kv], kv_replay_endpoints=[x or None for x in _split(args.kv_replay)],
        l2_lookup=l2_lookup, l2_timeout=args.l2fs_timeout,
        l2_min_tokens=args.l2fs_min_tokens, l2_lookup_when=args.l2fs_lookup, discovery=discovery,
        admission=AdmissionConfig(max_inflight=args.max_inflight, max_inflight_per_replica=args.max_inflight_per_replica,
                                  max_queue=args.max_queue, queue_timeout=args.queue_timeout,
                                  retry_after=args.retry_after),
        freeze_heap=True)
    sock = _tcp_socket(args.host)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sockets = [sock]
    if args.worker_of is not None:  # one of --workers N: share the port; a private loopback port for /metrics
        peers_dir, _, wid = args.worker_of.rpartition(":")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        priv = _tcp_socket("127.0.0.1")
        priv.bind(("127.0.0.1", 0))
        priv.listen(64)
        sockets.append(priv)
        cfg.peers_dir, cfg.worker_id, cfg.peers_tls = peers_dir, int(wid), bool(args.tls_cert)
    sock.bind((args.host, args.port))
    sock.listen(2048)  # connections queue until uvicorn accepts, so the printed URL works at once
    port = sock.getsockname()[1]
    if args.worker_of is not None:
        tmp = os.path.join(cfg.peers_dir or "", f"{cfg.worker_id}.port.tmp")
        with open(tmp, "w") as f:
            f.write(str(priv.getsockname()[1]))
        os.replace(tmp, tmp[:-4])
    scheme = "https" if args.tls_cert else "http"
    fastapi_app = create_app(cfg)
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    if haproxy_bin is not None:  # haproxy takes the public socket; the app answers on a private loopback one
        from router.haproxy import HaproxyFront

        priv = _tcp_socket("127.0.0.1")
        priv.bind(("127.0.0.1", 0))
        priv.listen(256)
        try:
            front = HaproxyFront(fastapi_app.state.router, sock, priv.getsockname()[1], binary=haproxy_bin,
                                 threads=args.haproxy_threads, fast_body=args.haproxy_body_bytes, tls=tls)
        except ValueError as e:
            print(f"kvtier router: {e}", file=sys.stderr)
            return 2
        fastapi_app.state.fronts.append(front)
        sockets, tls = [priv], None
    # the two proxy endpoints skip FastAPI's middleware stack (router.app.FastFront); the rest is FastAPI's
    app = FastFront(fastapi_app)
    # uvicorn loads the certificate in Config.load() (inside serve), so a bad pair fails before we print
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                            timeout_keep_alive=args.keep_alive_timeout,
                            ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
    if tls:
        try:
            config.load()
        except Exception as e:  # noqa: BLE001 - ssl.SSLError, ValueError...: report it plainly
            print(f"kvtier router: cannot load TLS certificate/key: {e}", file=sys.stderr)
            return 2
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"kvtier router listening on {scheme}://{host}:{port} strategy={args.strategy} "
          f"data-path={args.data_path}", flush=True)
    server = uvicorn.Server(config)
    run_loop(server.serve(sockets=sockets), args.loop)
    return 0


def _tcp_socket(host: str) -> socket.socket:
    """A listening socket whose accepted connections get TCP_NODELAY. asyncio sets it only on sockets whose
    proto is IPPROTO_TCP, and socket.socket() leaves proto 0: without it a response written as headers, then
    body waited for the client's delayed ACK (Nagle), ~40 ms p50 at 200 req/s in a quiet-box run
    (docs/results/2026-12-04-router-nodelay.md); uvloop sets it on every TCP connection."""
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def run_loop(coro: Any, loop: str = "asyncio") -> None:
    """Run the server on asyncio's own loop, or on uvloop (--loop uvloop, or auto where it is installed): uvicorn
    picks uvloop only in Server.run(), not for serve() on our pre-bound sockets."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise SystemExit("kvtier router: --loop uvloop, but uvloop is not installed") from None
        else:
            uvloop.run(coro)
            return
    asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
