"""Every KVTIER_* environment variable the kvtier packages read, in one table (as vLLM's envs.py; L2FS_* ones are
in l2fs/envs.py), and the one place they are read (tests/kvtier/test_kvtier_envs.py fails on any other read).
DEPLOY: the keys of deploy/'s kvtier-config ConfigMap that no program reads, only the manifests.

The bottom layer, below kvtier.contract: connector, router, operator_patch and the contract import it, so it
imports only the stdlib (not even l2fs.envs, whose table has the same columns). `python -m kvtier.envs` prints
the tables. Unset and empty are the same, except for the operator flags' family (PATCH_FLAG).
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple


class Var(NamedTuple):
    name: str
    default: str | None
    meaning: str


VARS: dict[str, Var] = {v.name: v for v in (
    Var("KVTIER_KV_SALT", None, "the cache-key salt itself (tests, dev); KVTIER_KV_SALT_FILE wins"),
    Var("KVTIER_KV_SALT_FILE", None, "file holding the cache-key salt (a mounted Secret key)"),
    Var("KVTIER_KV_SALT_DIR", None, "router: directory with one salt file per endpoint under --l2fs-prefix"),
    Var("KVTIER_REPLICA_ID", None, "connector: this replica's id in key-compat fingerprints (default "
                                   "<node>-<pid>)"),
    Var("KVTIER_PREFILL_TOKENS_PER_S", None, "connectors: this replica's prefill rate, tokens/s; L2 loads are "
                                             "claimed only while they beat recomputing (0/unset: always)"),
    Var("KVTIER_PREFILL_TOKENS_PER_S_FILE", None, "connectors: a file holding that rate, re-read while it "
                                                  "changes (a figure measured after start)"),
    Var("KVTIER_CPU_CONNECTOR", "1", "'0' leaves the CPU paged-KV connector out of lmcache-config"),
    Var("KVTIER_CPU_CONNECTOR_FAULT", "", "tests only: a fault the CPU paged-KV connector injects"),
    Var("KVTIER_REPLICAS", "", "router: --replicas (comma-separated base URLs)"),
    Var("KVTIER_ROUTER_API_KEY", None, "router: --api-key clients must send"),
    Var("KVTIER_ROUTER_TLS_CERT", None, "router: --tls-cert"),
    Var("KVTIER_ROUTER_TLS_KEY", None, "router: --tls-key"),
    Var("KVTIER_UPSTREAM_API_KEY", None, "router: --upstream-api-key sent to the replicas"),
    Var("KVTIER_ROUTER_PREFIX_AFFINITY", "", "router: --prefix-affinity unless '', '0' or 'false'"),
    Var("KVTIER_ROUTER_WORKERS", "1", "router: --workers (router processes on one port)"),
    Var("KVTIER_ROUTER_DATA_PATH", "python", "router: --data-path (python, or haproxy: a haproxy child carries "
                                             "the requests)"),
    Var("KVTIER_BENCH_API_KEY", None, "kvtier bench cross-pod: bearer token for the replicas"),
)}

# `kvtier webhook` / `kvtier operator-patch`: every flag --x-y also reads KVTIER_X_Y (deploy/ feeds them from one
# ConfigMap), e.g. KVTIER_MODE, KVTIER_MASTER, KVTIER_PREFIX, KVTIER_TOKEN_SECRET; "" is kept ('' = none where
# the flag says so). One family row, so a new flag needs no second entry here.
PATCH_FLAG = Var("KVTIER_<FLAG>", None, "kvtier webhook / operator-patch: the default of flag --<flag> "
                                        "(operator_patch/options.py); '' is a value")

# deploy/'s kvtier-config ConfigMap (deploy/base/config.env; overlays and components merge into it) feeds every
# container (envFrom). These keys of it no program reads from its environment: the manifests expand them into
# flags ($(VAR) in args, $VAR in the mount's shell command) and host paths (deploy/base's replacements). Every
# other key of it is a row of VARS, a KVTIER_<FLAG> of PATCH_FLAG or a row of l2fs/envs.py
# (tests/kvtier/test_kvtier_envs.py: each key in exactly one, each row here a key with config.env's value).
# Defaults are deploy/base/config.env's.
DEPLOY: dict[str, Var] = {v.name: v for v in (
    Var("L2FS_MASTER_PORT", "8995", "master.yaml: the master's gRPC --port"),
    Var("L2FS_MASTER_METRICS_PORT", "9090", "master.yaml: the master's --metrics-port (/metrics, probes)"),
    Var("L2FS_HEARTBEAT_TIMEOUT", "10", "master.yaml: --heartbeat-timeout, seconds until a silent worker is dead"),
    Var("L2FS_MASTER_JOURNAL", "/var/lib/l2fs-master/journal.db",
        "master.yaml: --journal, pending deletes/renames on the master's PersistentVolume"),
    Var("L2FS_WORKER_PORT", "8997", "worker.yaml: the worker's gRPC --port (also in its --advertise)"),
    Var("L2FS_WORKER_DATA_PORT", "8998", "worker.yaml: the worker's raw-TCP --data-port"),
    Var("L2FS_WORKER_METRICS_PORT", "9091", "worker.yaml: the worker's --metrics-port (/metrics, probes)"),
    Var("L2FS_DATA_DIR", "/opt/dlami/nvme/l2fs", "worker.yaml: the node's NVMe dir of blocks (--data-dir, and "
                                                 "the worker's hostPath by base's replacements)"),
    Var("L2FS_SOCKET_DIR", "/run/l2fs", "worker.yaml: node dir holding only the fd-passing socket "
                                        "(--domain-socket <dir>/worker.sock; hostPath by base's replacements)"),
    Var("L2FS_DATA_CAPACITY", "500G", "worker.yaml: the data dir's capacity (--data-dir DIR:CAPACITY); "
                                      "overlays set their nodes' NVMe"),
    Var("L2FS_HIGH_WATERMARK", "0.9", "worker.yaml: --high-watermark, usage that starts eviction"),
    Var("L2FS_LOW_WATERMARK", "0.8", "worker.yaml: --low-watermark, usage eviction stops at"),
    Var("L2FS_MOUNT_PATH", "/mnt/l2fs", "mount.yaml: where the node's FUSE mounts live (hostPath by base's "
                                        "replacements)"),
    Var("L2FS_MOUNT_TIMEOUT", "2", "mount.yaml: l2fs mount --timeout, seconds per call"),
    Var("L2FS_MOUNT_UID", "0", "mount.yaml: l2fs mount --uid, owner of the mount's files (the vLLM uid)"),
    Var("L2FS_MOUNT_GID", "0", "mount.yaml: l2fs mount --gid"),
    Var("L2FS_MOUNT_UMASK", "022", "mount.yaml: l2fs mount --umask"),
    Var("L2FS_MOUNT_SERVER", "auto", "mount.yaml: which mount runs: auto (passthrough where the kernel offers "
                                     "it, probed, else pyfuse3), pyfuse3 or passthrough (read-write FUSE "
                                     "passthrough, Linux >= 6.9)"),
    Var("L2FS_MOUNT_CACHE_DIR", "/var/cache/l2fs-mount", "mount.yaml, passthrough: --cache-dir (an emptyDir)"),
    Var("L2FS_MOUNT_CACHE_SIZE", "4G", "mount.yaml, passthrough: --cache-size, cross-node copies kept per "
                                       "endpoint mount"),
    Var("L2FS_MOUNT_ENDPOINTS_DIR", "/etc/l2fs-endpoint-mounts",
        "mount.yaml: l2fs mount --endpoints, one file per endpoint (Secret l2fs-endpoint-mounts)"),
    Var("L2FS_MOUNT_STATUS_FILE", "/tmp/l2fs-mounts.status",
        "mount.yaml: l2fs mount --status-file, read by the mount pod's probes"),
    Var("L2FS_MOUNT_TOKEN_FILE", "/var/run/secrets/l2fs/token",
        "a mount's projected ServiceAccount token (l2fs mount --token-file, reviewed as L2FS_MOUNT_SA); "
        "base's per-endpoint mounts use their endpoints' tokens instead, the insecure component empties it"),
    Var("L2FS_TOKEN_VERIFIERS_FILE", "/etc/l2fs-verifiers/verifiers.json",
        "worker.yaml: the worker's --tokens-file, SHA-256 verifiers only (Secret l2fs-token-verifiers)"),
    Var("L2FS_WORKER_TOKEN_FILE", "/var/run/secrets/l2fs/token",
        "worker.yaml: the worker's --token-file, its pod's projected ServiceAccount token"),
    Var("KVTIER_WEBHOOK_PORT", "8443", "webhook.yaml: `kvtier webhook --port` (HTTPS)"),
)}


def get(name: str) -> str | None:
    """A KVTIER_* variable of VARS (KeyError for any other name): its value, or its default when unset or ''."""
    return os.environ.get(name) or VARS[name].default


def patch_flag(flag: str) -> str | None:
    """The KVTIER_<FLAG> variable of an operator_patch flag ('--token-secret' -> $KVTIER_TOKEN_SECRET), None
    when unset; '' is returned as ''."""
    return os.environ.get("KVTIER_" + flag.lstrip("-").replace("-", "_").upper())


def __getattr__(name: str) -> str | None:
    if name in VARS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    for v in (*VARS.values(), PATCH_FLAG):
        sys.stdout.write(f"{v.name}\t{v.default if v.default is not None else '(unset)'}\t{v.meaning}\n")
    sys.stdout.write("\n# deploy/'s kvtier-config keys only the manifests read (DEPLOY)\n")
    for v in DEPLOY.values():
        sys.stdout.write(f"{v.name}\t{v.default}\t{v.meaning}\n")
