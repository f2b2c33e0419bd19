"""`l2fs master`: flags, startup (tokens, block key, identity, journal) and the serve loop."""

from __future__ import annotations

import argparse
import logging
import sqlite3
import sys

from l2fs import envs
from l2fs.common import (
    DEFAULT_MAX_FILE_SIZE,
    BlockKey,
    BlockKeyError,
    Credentials,
    PathError,
    TokensFileError,
    capability,
    load_block_key,
    norm_path,
    parse_shard,
    parse_size,
    start_metrics_server,
    wait_for_stop_signal,
    write_port_file,
)
from l2fs.common.auth import ENDPOINT_WRITES
from l2fs.master.identity import CACHE_TTL
from l2fs.master.journal import JournalError
from l2fs.master.namespace import MAX_DIRS_PER_CREDENTIAL
from l2fs.master.registry import FORGET_DEAD_AFTER
from l2fs.master.service import MasterService, serve


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="l2fs master", description="Run the l2fs metadata master.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8995, help="gRPC port (0 = pick a free one)")
    p.add_argument("--port-file", help="write {'port':..., 'metrics_port':...} JSON here once bound")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP /metrics and /healthz port (0 = pick a free one; default: off)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds without a heartbeat before a worker is dead (default 10)")
    p.add_argument("--max-file-size", default=str(DEFAULT_MAX_FILE_SIZE), help="e.g. 1G (default)")
    p.add_argument("--forget-dead-after", type=float, default=FORGET_DEAD_AFTER, metavar="SECONDS",
                   help=f"drop a dead worker's entry after this long (default {FORGET_DEAD_AFTER:g})")
    p.add_argument("--max-dirs-per-credential", type=int, default=MAX_DIRS_PER_CREDENTIAL, metavar="N",
                   help="directories one non-admin credential may make with Mkdir (default "
                        f"{MAX_DIRS_PER_CREDENTIAL}; each also counts 4 KiB against the --prefix-quota above it)")
    p.add_argument("--allocation-ttl", type=float, default=600.0,
                   help="seconds a put may take from Allocate to Commit; older uncommitted blocks are deleted "
                        "and never published (default 600)")
    p.add_argument("--journal", default=None,
                   help="SQLite file (on a volume) where deletes and renames wait until their worker confirms "
                        "them, so they survive a master restart; without it they wait in memory")
    p.add_argument("--prefix-quota", action="append", default=[], metavar="PREFIX=SIZE",
                   help="at most SIZE bytes of files under PREFIX (e.g. /kvtier/kv/a=10GiB; repeatable): writes "
                        "beyond it are refused (RESOURCE_EXHAUSTED, a failed put) instead of evicting others")
    p.add_argument("--token", default=None,
                   help="require this bearer token (also $L2FS_TOKEN). Alone it is one shared secret with admin + "
                        "worker rights for every holder (insecure between pods); with --tokens-file it is only "
                        "the token the master calls workers with")
    p.add_argument("--tokens-file", default=envs.get("L2FS_TOKENS_FILE"),
                   help="JSON list of {name, token, role: worker|engine|router|admin, prefixes}: scoped tokens "
                        "(also $L2FS_TOKENS_FILE); see docs/l2fs.md")
    p.add_argument("--worker-identity", choices=("tokens", "k8s"), default=envs.get("L2FS_WORKER_IDENTITY"),
                   help="how workers prove who they are: worker-role entries of the tokens file "
                   "(default), or k8s: a projected ServiceAccount token checked with a TokenReview, bound to the "
                   "node the review names (l2fs/master/identity.py; also $L2FS_WORKER_IDENTITY)")
    p.add_argument("--worker-sa", default=envs.get("L2FS_WORKER_SA"),
                   metavar="NAMESPACE:NAME", help="with --worker-identity k8s: the workers' ServiceAccount")
    p.add_argument("--worker-audience", default=envs.get("L2FS_WORKER_AUDIENCE"),
                   help="with --worker-identity k8s: the audience the workers' tokens must carry (default l2fs)")
    p.add_argument("--mount-sa", default=envs.get("L2FS_MOUNT_SA"), metavar="NAMESPACE:NAME",
                   help="the FUSE mounts' ServiceAccount (also $L2FS_MOUNT_SA): a mount pod's projected token "
                        "(--worker-audience), checked with a TokenReview, becomes the mount credential "
                        "mount@<node>, so a mount replaces or deletes only files written through its own node's "
                        "mount. Default: none (mounts use tokens-file entries)")
    p.add_argument("--mount-prefixes", default=envs.get("L2FS_MOUNT_PREFIXES"),
                   metavar="P1,P2", help=f"with --mount-sa: the prefixes the mounts may write under (default "
                                         f"{envs.VARS['L2FS_MOUNT_PREFIXES'].default}, what `kvtier tokens generate --mount` gives)")
    p.add_argument("--endpoint-writes", choices=ENDPOINT_WRITES, default="plugin",
                   help="how endpoints write their KV: plugin (default: each with its engine credential, so a "
                        "prefix an engine credential of the tokens file serves is closed to every mount: a node's "
                        "mount cannot plant another endpoint's chunks) or mount (through the node FUSE mounts, "
                        "which then may write under every endpoint's prefix; deploy/ passes $(KVTIER_MODE))")
    p.add_argument("--review-cache-ttl", type=float, default=CACHE_TTL, metavar="SECONDS",
                   help=f"with --worker-identity k8s or --mount-sa: seconds a positive TokenReview is trusted "
                        f"(renewed after two thirds of it, on a budget made-up tokens cannot reach; default "
                        f"{CACHE_TTL:g})")
    p.add_argument("--kubeconfig", default=None,
                   help="with --worker-identity k8s or --mount-sa: API server config (default $KUBECONFIG, else "
                        "in-cluster)")
    p.add_argument("--block-key-file", default=envs.get("L2FS_BLOCK_KEY_FILE"),
                   help="file of >= 32 random bytes shared by every master (also $L2FS_BLOCK_KEY_FILE): block ids "
                        "become a MAC over (worker id, size), and commits or worker reports of ids it does not "
                        "verify are not published. Without it: uuid4 ids, no check. Turning it on unpublishes "
                        "blocks written before (docs/l2fs.md)")
    p.add_argument("--capability-ttl", type=float, default=capability.DEFAULT_TTL, metavar="SECONDS",
                   help="with --block-key-file: seconds a block capability the master hands a client stays valid "
                        f"(workers allow their --capability-skew more; default {capability.DEFAULT_TTL:g})")
    p.add_argument("--shard", default="0/1", metavar="INDEX/COUNT",
                   help="this master's shard of a path-hash sharded namespace (e.g. 0/2; default 0/1 = the whole "
                        "namespace). Paths that hash to another shard are refused (FAILED_PRECONDITION)")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca", help="CA to verify workers when the master calls them over TLS")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shard = parse_shard(args.shard)
    except ValueError as e:
        parser.error(f"--shard: {e}")
    quotas: dict[str, int] = {}
    for spec in args.prefix_quota:
        prefix, _, size = spec.rpartition("=")
        try:
            quotas[norm_path(prefix)] = parse_size(size.removesuffix("iB").removesuffix("B") if size else "")
        except (ValueError, PathError) as e:
            parser.error(f"--prefix-quota {spec!r}: expected PREFIX=SIZE like /kvtier/kv/a=10GiB ({e})")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = args.token or envs.get("L2FS_TOKEN")
    try:
        identity = None
        if args.worker_identity == "k8s" or args.mount_sa:
            from l2fs.master.identity import K8sIdentity

            prefixes = tuple(norm_path(p.strip()) for p in args.mount_prefixes.split(",") if p.strip())
            identity = K8sIdentity(args.worker_sa if args.worker_identity == "k8s" else None, args.worker_audience,
                                   args.kubeconfig, cache_ttl=args.review_cache_ttl, mount_sa=args.mount_sa,
                                   mount_prefixes=prefixes)
        creds = Credentials(token, args.tokens_file, identity, endpoint_writes=args.endpoint_writes)
    except (TokensFileError, ValueError, PathError) as e:
        print(f"l2fs master: {e}", file=sys.stderr)
        return 2
    if args.capability_ttl <= 0:
        parser.error("--capability-ttl must be > 0 seconds")
    if args.max_dirs_per_credential < 1:
        parser.error("--max-dirs-per-credential must be >= 1")
    if args.review_cache_ttl <= 0 or args.forget_dead_after <= 0:
        parser.error("--review-cache-ttl and --forget-dead-after must be > 0 seconds")
    try:
        block_key = BlockKey(load_block_key(args.block_key_file)) if args.block_key_file else None
    except BlockKeyError as e:
        print(f"l2fs master: {e}", file=sys.stderr)
        return 2
    try:
        service = MasterService(heartbeat_timeout=args.heartbeat_timeout,
                                max_file_size=parse_size(args.max_file_size), token=token, tls_ca=args.tls_ca,
                                allocation_ttl=args.allocation_ttl, journal=args.journal, prefix_quotas=quotas,
                                creds=creds, shard=shard, block_key=block_key,
                                capability_ttl=args.capability_ttl)
        service.forget_dead_after = args.forget_dead_after
        service.max_dirs_per_credential = args.max_dirs_per_credential
    except (JournalError, OSError, sqlite3.Error) as e:
        print(f"l2fs master: cannot open the journal: {e}", file=sys.stderr)
        return 2
    server, port = serve(args.host, args.port, service, token=token, tls_cert=args.tls_cert,
                         tls_key=args.tls_key)
    metrics_port = None
    if args.metrics_port is not None:
        metrics_port = start_metrics_server(args.host, args.metrics_port, service.health).server_address[1]
    write_port_file(args.port_file, port=port, metrics_port=metrics_port)
    print(f"l2fs master listening on {args.host}:{port}"
          + (f" (metrics on http://{args.host}:{metrics_port}/metrics)" if metrics_port else ""), flush=True)
    wait_for_stop_signal()
    service.close()
    server.stop(grace=1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
