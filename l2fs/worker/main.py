"""l2fs worker: the `l2fs worker` command. Assembles a worker from its parts and runs it.

The parts: `l2fs.worker.store` (data dirs, manifests, eviction), `l2fs.worker.service` (gRPC), `l2fs.dataplane`
(raw-TCP bulk bytes) and `l2fs.worker.registration` (heartbeat and block reports to the master).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sqlite3
import sys
import threading
from contextlib import closing
from pathlib import Path

from l2fs import envs
from l2fs.common import (
    DEFAULT_MAX_FILE_SIZE,
    WORKER_ID_SEP,
    Credentials,
    FileToken,
    TokensFileError,
    capability,
    grpc_server,
    new_worker_id,
    parse_size,
    start_metrics_server,
    wait_for_stop_signal,
    worker_node,
    write_port_file,
)
from l2fs.common.fdpass import default_socket_path
from l2fs.common.protocol import MANIFEST_VERSION, SIZED_CAPABILITIES
from l2fs.dataplane import server as dataplane  # the module: it imports l2fs.worker.store (a cycle)
from l2fs.dataplane.wire import DATA_IDLE_TIMEOUT, DATA_MAX_CONNS
from l2fs.options import add_client_args
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.worker.fdserver import FdServer
from l2fs.worker.registration import MasterLinks
from l2fs.worker.service import WORKER_POLICY, WorkerService
from l2fs.worker.store import RESERVATION_TTL, RESERVED_FRACTION, TIERS, Store, private_file


class Worker:
    """gRPC server + data-plane server + the link to the master, over one store."""

    def __init__(self, store: Store, *, master: str, node_id: str, worker_id: str, host: str, port: int,
                 advertise: str | None, heartbeat_interval: float, token: str | None, tls_cert: str | None,
                 tls_key: str | None, tls_ca: str | None, threads: int = 32, data_port: int | None = 0,
                 data_max_conns: int = DATA_MAX_CONNS, data_idle_timeout: float = DATA_IDLE_TIMEOUT,
                 creds: Credentials | None = None, domain_socket: str = "", socket_required: bool = False,
                 capability_skew: float = capability.DEFAULT_SKEW) -> None:
        """`token` is what this worker sends to the master; `creds` (a tokens file) what it accepts, else
        the same single `token` (the shared-secret mode). `domain_socket`: the Unix socket passing block fds
        to same-node clients ("" = none); when it cannot be opened the worker runs without it, unless
        `socket_required` (an explicit --domain-socket), then the error is raised."""
        self.store = store
        creds = creds if creds is not None and creds.enabled else Credentials(token)
        self.node_id, self.worker_id = node_id, worker_id
        wake = threading.Event()  # set by the servers when blocks were removed/moved: report them now
        # what the data plane, the fd socket and the block calls accept: per-block capabilities once a master
        # with a block key hands us our data key at registration, else the tokens (l2fs/common/capability.py)
        self.gate = capability.DataGate(creds.data_token_ok, capability_skew)
        self.server, self.port, tls = grpc_server(
            host, port, lambda s: pbg.add_WorkerServicer_to_server(WorkerService(store, wake.set, self.gate), s),
            name="l2fs-worker", creds=creds, policy=WORKER_POLICY, tls_cert=tls_cert, tls_key=tls_key,
            threads=threads)
        if not advertise and host in ("0.0.0.0", "::", ""):
            advertise = f"{_host_ip(master)}:{self.port}"
        self.address = advertise or f"{host}:{self.port}"
        self.data: dataplane.DataServer | None = None
        if data_port is not None and not tls:  # raw TCP is plaintext: TLS clusters use gRPC only
            self.data = dataplane.DataServer(store, host, data_port, self.gate.check, wake.set, max_conns=data_max_conns,
                                   idle_timeout=data_idle_timeout)
        self.fds: FdServer | None = None
        if domain_socket:
            try:
                self.fds = FdServer(store, domain_socket, creds, wake, gate=self.gate)
            except (OSError, ValueError) as e:
                if socket_required:
                    raise
                logging.getLogger("l2fs.worker").warning("no fd-passing socket at %s: %s", domain_socket, e)
        adv_host = self.address.rpartition(":")[0]
        self.data_address = f"{adv_host}:{self.data.port}" if self.data else ""
        self.link = MasterLinks(store, master=master, tls_ca=tls_ca, token=token, worker_id=worker_id,
                                node_id=node_id, address=self.address, data_address=self.data_address,
                                heartbeat_interval=heartbeat_interval, wake=wake,
                                domain_socket=self.fds.path if self.fds else "", on_data_key=self._data_key)

    def _data_key(self, key: bytes) -> None:
        link = getattr(self, "link", None)  # every master answered: their write capabilities bind the size
        if key and link is not None and link.master_version >= SIZED_CAPABILITIES:
            self.gate.sized = True  # and stays so until restarted (fail closed, like cap mode)
        if self.gate.set_key(key):
            logging.getLogger("l2fs.worker").info(
                "data plane: %s", "block capabilities (the master's data key)" if self.gate.cap_mode
                else "tokens (the master issues no block capabilities)")

    @property
    def registered(self) -> bool:
        return self.link.registered

    def start(self) -> None:
        self.server.start()
        if self.data is not None:
            self.data.start()
        if self.fds is not None:
            self.fds.start()
        self.link.start()

    def stop(self) -> None:
        self.link.stop()
        if self.data is not None:
            self.data.stop()
        if self.fds is not None:
            self.fds.stop()
        self.server.stop(grace=1).wait()


def _host_ip(master: str = "") -> str:
    """This node's address as others see it (for workers bound to 0.0.0.0 without --advertise).

    The source address of the route to the master: hostname lookups often give 127.0.0.1, which no
    other node can reach. A UDP connect sends nothing; it only asks the kernel which interface routes there.
    """
    first = master.replace(";", ",").split(",")[0].strip()
    host = first.rpartition(":")[0].strip("[]") if ":" in first else first
    if host:
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def parse_data_dir(spec: str) -> tuple[Path, int, int]:
    """'[TIER]PATH[:CAPACITY]' -> (path, bytes, tier rank). TIER is MEM, SSD (default), DISK or HDD, as in
    Curvine; capacity defaults to the filesystem's free space."""
    tier = TIERS["SSD"]
    m = re.match(r"^\[([A-Za-z]+)\](.*)$", spec)
    if m:
        if m.group(1).upper() not in TIERS:
            raise ValueError(f"unknown tier [{m.group(1)}] in {spec!r} (use MEM, SSD, DISK or HDD)")
        tier, spec = TIERS[m.group(1).upper()], m.group(2)
    path, _, cap = spec.rpartition(":") if re.search(r":\d+(\.\d+)?[kmgtKMGT]?i?[bB]?$", spec) else (spec, "", "")
    p = Path(path).resolve()
    p.mkdir(parents=True, exist_ok=True)
    if cap:
        return p, parse_size(cap), tier
    st = os.statvfs(p)
    return p, st.f_bavail * st.f_frsize, tier


def manifest_too_new(dirs: list[tuple[Path, int, int]]) -> str | None:
    """Why this worker must not open these data dirs (a manifest written by a newer format), or None.
    Checked before the store opens them, so nothing is misread or rewritten."""
    for path, _, _ in dirs:
        f = path / "manifest.sqlite3"
        if not f.exists():
            continue
        with closing(sqlite3.connect(f)) as db:
            v = db.execute("PRAGMA user_version").fetchone()[0]
        if v > MANIFEST_VERSION:
            return (f"{f} has manifest format {v}; this worker reads formats up to {MANIFEST_VERSION}: "
                    f"upgrade the worker (or give it an empty data dir)")
    return None


def stamp_manifests(store: Store) -> None:
    """Mark unstamped (older, same-format) manifests with this format version."""
    for d in store.dirs:
        if d.db.execute("PRAGMA user_version").fetchone()[0] < MANIFEST_VERSION:
            d.db.execute(f"PRAGMA user_version={MANIFEST_VERSION}")


def _worker_id(first_dir: Path, node_id: str) -> str:
    """Stable across restarts: stored (0600) in the first data dir the first time. An id stored for another
    node, or in the older "<node>-<hex>" form that a node-bound credential no longer accepts (a longer node
    name could extend it), is replaced by a fresh "<node>@<hex>" one: its blocks' ids are bound to the old
    id, so the master does not publish them again (recomputable cache)."""
    f = first_dir / "worker_id"
    if f.exists():
        wid = f.read_text().strip()
        if worker_node(wid) == node_id:
            private_file(f)
            return wid
        logging.getLogger("l2fs.worker").warning(
            "stored worker id %r is not of node %r in the exact form <node>%s<suffix>: starting as a new worker "
            "id (blocks stored under the old one are not published again)", wid, node_id, WORKER_ID_SEP)
    wid = new_worker_id(node_id)
    tmp = f.with_name("worker_id.tmp")
    tmp.unlink(missing_ok=True)
    os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
    tmp.write_text(wid)
    tmp.replace(f)
    return wid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="l2fs worker", description="Run an l2fs block-storing worker.")
    add_client_args(p, timeout=None, help={
        "master": "master host:port ($L2FS_MASTER)",
        "node_id": "the node this worker registers under ($L2FS_NODE_ID, else the hostname)",
        "token": "bearer token ($L2FS_TOKEN): alone, the cluster's one shared secret (insecure between pods); "
                 "with --tokens-file, this worker's own worker-role token for the master",
        "token_file": "read the bearer token for the master from PATH at every registration/heartbeat (a "
                      "projected ServiceAccount token for a master with --worker-identity k8s; also "
                      "$L2FS_TOKEN_FILE). Needs --tokens-file (what this worker accepts)",
        "tls_ca": "CA to verify the master's TLS certificate ($L2FS_TLS_CA)"})
    p.add_argument("--data-dir", action="append", required=True, metavar="[TIER]PATH[:CAPACITY]",
                   help="storage dir, repeatable; capacity like 10G or 512M (default: free space); optional "
                        "tier [MEM]/[SSD]/[HDD]: new blocks go to the fastest tier, cold ones move down")
    p.add_argument("--worker-id", default=None, help="default: stored in the first data dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8997, help="gRPC port (0 = pick a free one)")
    p.add_argument("--advertise", default=None, help="host:port the master gives clients (default host:port)")
    p.add_argument("--data-port", type=int, default=0,
                   help="raw-TCP data plane port (0 = pick a free one; -1 = off, gRPC streaming only)")
    p.add_argument("--port-file")
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--high-watermark", type=float, default=0.9)
    p.add_argument("--low-watermark", type=float, default=0.8)
    p.add_argument("--max-file-size", default=str(DEFAULT_MAX_FILE_SIZE))
    p.add_argument("--max-reserved", type=float, default=RESERVED_FRACTION,
                   help="fraction of a data dir's capacity that unfinished writes may reserve; one write is "
                        "always admitted, more beyond it get RESOURCE_EXHAUSTED")
    p.add_argument("--reservation-ttl", type=float, default=RESERVATION_TTL,
                   help="seconds an unadopted short-circuit reservation is held")
    p.add_argument("--data-max-conns", type=int, default=DATA_MAX_CONNS,
                   help="concurrent data-plane connections; more are refused with a message")
    p.add_argument("--data-idle-timeout", type=float, default=DATA_IDLE_TIMEOUT,
                   help="seconds an idle data-plane connection is kept")
    p.add_argument("--domain-socket", default=None, metavar="PATH",
                   help="Unix socket passing block file descriptors to same-node clients, so their pods need "
                        "no data dir mount (default: l2fs-<worker id>.sock next to the first data dir; "
                        "'' = off)")
    p.add_argument("--capability-skew", type=float, default=capability.DEFAULT_SKEW, metavar="SECONDS",
                   help="seconds a block capability is still accepted past its expiry (clock difference to the "
                        f"master; default {capability.DEFAULT_SKEW:g})")
    p.add_argument("--tokens-file", default=envs.get("L2FS_TOKENS_FILE"),
                   help="JSON list of {name, token, role, prefixes} this worker accepts (also $L2FS_TOKENS_FILE)")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--log-level", default="INFO")
    return p


def _build(args: argparse.Namespace, store: Store, worker_id: str, token: str | None, creds: Credentials,
           sock: str) -> Worker:
    return Worker(store, master=args.master, node_id=args.node_id, worker_id=worker_id, host=args.host,
                  port=args.port, advertise=args.advertise, heartbeat_interval=args.heartbeat_interval,
                  token=token, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                  data_port=None if args.data_port < 0 else args.data_port,
                  data_max_conns=args.data_max_conns, data_idle_timeout=args.data_idle_timeout, creds=creds,
                  domain_socket=sock, socket_required=bool(args.domain_socket),
                  capability_skew=args.capability_skew)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.master:
        print("l2fs worker: --master or $L2FS_MASTER is required", file=sys.stderr)
        return 2
    if not 0 < args.low_watermark <= args.high_watermark <= 1:
        print("l2fs worker: need 0 < low watermark <= high watermark <= 1", file=sys.stderr)
        return 2
    dirs = [parse_data_dir(s) for s in args.data_dir]
    token = args.token or None
    try:
        creds = Credentials(token, args.tokens_file)
    except TokensFileError as e:
        print(f"l2fs worker: {e}", file=sys.stderr)
        return 2
    if args.token_file:
        if not args.tokens_file:
            print("l2fs worker: --token-file needs --tokens-file (the tokens this worker accepts)", file=sys.stderr)
            return 2
        token = FileToken(args.token_file)
    if not 0 < args.max_reserved <= 1 or args.reservation_ttl <= 0:
        print("l2fs worker: need 0 < --max-reserved <= 1 and --reservation-ttl > 0", file=sys.stderr)
        return 2
    if args.capability_skew < 0:
        print("l2fs worker: need --capability-skew >= 0", file=sys.stderr)
        return 2
    if args.data_max_conns < 1 or args.data_idle_timeout <= 0:
        print("l2fs worker: need --data-max-conns >= 1 and --data-idle-timeout > 0", file=sys.stderr)
        return 2
    if not args.node_id or WORKER_ID_SEP in args.node_id:
        print(f"l2fs worker: --node-id must be a non-empty node name without {WORKER_ID_SEP!r} (it separates a "
              f"worker id's node from its suffix)", file=sys.stderr)
        return 2
    why = manifest_too_new(dirs)
    if why:
        print(f"l2fs worker: {why}", file=sys.stderr)
        return 2
    store = Store(dirs, high=args.high_watermark, low=args.low_watermark,
                  max_file_size=parse_size(args.max_file_size), max_reserved=args.max_reserved,
                  reservation_ttl=args.reservation_ttl)
    stamp_manifests(store)
    worker_id = args.worker_id or _worker_id(dirs[0][0], args.node_id)
    sock = default_socket_path(dirs[0][0], worker_id) if args.domain_socket is None else args.domain_socket
    try:
        worker = _build(args, store, worker_id, token, creds, sock)
    except (OSError, ValueError) as e:  # only an explicit --domain-socket that cannot be opened raises here
        print(f"l2fs worker: --domain-socket {sock}: {e}", file=sys.stderr)
        return 2
    worker.start()
    metrics_port = None
    if args.metrics_port is not None:
        def health() -> dict:
            return {"ok": True, "ready": worker.registered, "role": "worker", "worker_id": worker.worker_id,
                    "node_id": worker.node_id, "registered": worker.registered, "capacity": store.capacity, "used": store.used,
                    "blocks": len(store.blocks), "domain_socket": worker.fds.path if worker.fds else ""}
        metrics_port = start_metrics_server(args.host, args.metrics_port, health).server_address[1]
    write_port_file(args.port_file, port=worker.port, metrics_port=metrics_port, worker_id=worker.worker_id,
                    data_address=worker.data_address)
    print(f"l2fs worker {worker.worker_id} (node {args.node_id}) listening on {worker.address}, "
          f"(data plane {worker.data_address or 'off'}, fd socket {worker.fds.path if worker.fds else 'off'}), {len(store.blocks)} blocks, {store.used}/{store.capacity} bytes used"
          + (f" (metrics on http://{args.host}:{metrics_port}/metrics)" if metrics_port else ""), flush=True)
    wait_for_stop_signal()
    worker.stop()
    store.flush_access()
    return 0


if __name__ == "__main__":
    sys.exit(main())
