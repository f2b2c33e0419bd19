"""Every KVTIER_* environment variable the kvtier packages read, in one table (as vLLM's envs.py; L2FS_* ones are
in l2fs/envs.py), and the one place they are read (tests/l2fs/test_l2fs_unit_envs.py fails on any other read).

The bottom layer, below kvtier.contract: connector, router, operator_patch and the contract import it, so it
imports only the stdlib (not even l2fs.envs, whose table has the same columns). `python -m kvtier.envs` prints
the table. Unset and empty are the same, except for the operator flags' family (PATCH_FLAG).
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
    Var("KVTIER_BENCH_API_KEY", None, "kvtier bench cross-pod: bearer token for the replicas"),
)}

# `kvtier webhook` / `kvtier operator-patch`: every flag --x-y also reads KVTIER_X_Y (deploy/ feeds them from one
# ConfigMap), e.g. KVTIER_MODE, KVTIER_MASTER, KVTIER_PREFIX, KVTIER_TOKEN_SECRET; "" is kept ('' = none where
# the flag says so). One family row, so a new flag needs no second entry here.
PATCH_FLAG = Var("KVTIER_<FLAG>", None, "kvtier webhook / operator-patch: the default of flag --<flag> "
                                        "(operator_patch/options.py); '' is a value")


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
