"""Every L2FS_* environment variable l2fs reads, in one table (as vLLM's envs.py), and the one place it reads them.

Why one place: the same variable was read in several modules with different defaults (L2FS_MASTER in 8 places,
L2FS_NODE_ID defaulting to "", None or the hostname). Code asks `envs.get(NAME)` (or `envs.NAME`); a name
missing from VARS is a KeyError, and tests/kvtier/test_kvtier_envs.py fails on any other read of an L2FS_* or
KVTIER_* variable in the product packages. KVTIER_* variables live in kvtier/envs.py (l2fs imports nothing of
kvtier). `python -m l2fs.envs` prints the table.

Unset and empty are the same ("" gives the default) unless a variable says `keep_empty`.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    default: str | None
    meaning: str
    keep_empty: bool = False  # "" is a value of its own (e.g. "" = off), not "unset"


VARS: dict[str, Var] = {v.name: v for v in (
    Var("L2FS_MASTER", None, "master address for clients, workers, mounts and connectors: HOST:PORT, "
                             "'H1:P,H2:P' (failover) or 'M0:P;M1:P' (shards, each started with --shard K/N)"),
    Var("L2FS_NODE_ID", None, "this process's node id: workers register under it; clients use it for "
                              "local-first placement and the same-node short circuit. Unset: the hostname "
                              "(node_id())"),
    Var("L2FS_TOKEN", None, "bearer token for the master and workers (clusters started with --token or a "
                            "tokens file)"),
    Var("L2FS_TOKEN_FILE", None, "file holding the bearer token, re-read at every call (a projected "
                                 "ServiceAccount token the kubelet rotates); wins over L2FS_TOKEN"),
    Var("L2FS_TLS_CA", None, "CA bundle: clients and workers use TLS to the master and workers"),
    Var("L2FS_TOKENS_FILE", None, "JSON list of {name, token, role, prefixes} a master or worker accepts "
                                  "(also what `kvtier tokens` writes)"),
    Var("L2FS_DATA_PLANE", "tcp", "clients: 'grpc' moves bulk bytes over gRPC streaming instead of the workers' "
                                  "raw-TCP data plane"),
    Var("L2FS_BLOCK_KEY_FILE", None, "master: file of >= 32 random bytes; block ids become MACs and reports "
                                     "of ids that do not verify are not published"),
    Var("L2FS_WORKER_IDENTITY", "tokens", "master: how workers prove who they are: 'tokens' (tokens file) or "
                                          "'k8s' (TokenReview of a projected ServiceAccount token)"),
    Var("L2FS_WORKER_SA", "kvtier:l2fs-worker", "master with k8s identity: the workers' ServiceAccount "
                                                "NAMESPACE:NAME"),
    Var("L2FS_WORKER_AUDIENCE", "l2fs", "master with k8s identity: the audience worker and mount tokens carry"),
    Var("L2FS_MOUNT_SA", None, "master: the FUSE mounts' ServiceAccount NAMESPACE:NAME (reviewed tokens become "
                               "mount@<node>)"),
    Var("L2FS_MOUNT_PREFIXES", "/kvtier/kv,/kvtier/mp,/kvtier/meta",
        "master with L2FS_MOUNT_SA: the prefixes mounts may write under (kvtier.contract's KV/MP/META "
        "prefixes, what `kvtier tokens generate --mount` gives; l2fs imports nothing of kvtier)"),
)}


def get(name: str) -> str | None:
    """The variable's value; its default when unset (or empty, unless it keeps empty values)."""
    var = VARS[name]
    value = os.environ.get(name)
    if value is None or (value == "" and not var.keep_empty):
        return var.default
    return value


def node_id() -> str:
    """The one node-id default of every l2fs command, client, fsspec and connector: $L2FS_NODE_ID, else the
    hostname (what a worker registers under when started without --node-id)."""
    return get("L2FS_NODE_ID") or socket.gethostname()


def __getattr__(name: str) -> str | None:
    if name in VARS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def table(vars_: dict[str, Var] | None = None) -> str:
    """The table as Markdown rows (name, default, meaning)."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for v in (vars_ or VARS).values():
        default = "(unset)" if v.default is None else f"`{v.default}`"
        rows.append(f"| `{v.name}` | {default} | {v.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
