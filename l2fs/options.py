"""The client options every l2fs caller shares: master, node id, token / token file, TLS CA, timeout.

Defined once (as Curvine's one client conf) and used by every command that talks to a master (`l2fs put|get|...`,
`l2fs mount`, `l2fs mount --passthrough`, `l2fs worker`), by the fsspec filesystem and by the connectors, so a
flag, its environment variable (l2fs.envs) and its default mean the same everywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from l2fs import envs
from l2fs.common.auth import FileToken

_HELP = {
    "master": "host:port, 'h1:p,h2:p' (failover) or 'm0:p;m1:p' (shards) ($L2FS_MASTER)",
    "node_id": "this node's id: local-first writes and short-circuit reads ($L2FS_NODE_ID, else the hostname)",
    "token": "bearer token ($L2FS_TOKEN)",
    "token_file": "read the bearer token from this file at every call ($L2FS_TOKEN_FILE; wins over --token)",
    "tls_ca": "CA bundle: use TLS to the master and workers ($L2FS_TLS_CA)",
    "timeout": "per-call deadline in seconds",
}


def add_client_args(parser: argparse.ArgumentParser, *, timeout: float | None = 2.0,
                    help: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:  # noqa: A002
    """Add --master, --node-id, --token, --token-file, --tls-ca and (unless `timeout` is None) --timeout, with
    their environment defaults. `help` overrides a flag's help where a command gives it a narrower meaning."""
    text = {**_HELP, **(help or {})}
    g = parser.add_argument_group("l2fs client options")
    g.add_argument("--master", default=envs.get("L2FS_MASTER"), help=text["master"])
    g.add_argument("--node-id", default=envs.node_id(), help=text["node_id"])
    g.add_argument("--token", default=envs.get("L2FS_TOKEN"), help=text["token"])
    g.add_argument("--token-file", default=envs.get("L2FS_TOKEN_FILE"), metavar="PATH", help=text["token_file"])
    g.add_argument("--tls-ca", default=envs.get("L2FS_TLS_CA"), help=text["tls_ca"])
    if timeout is not None:
        g.add_argument("--timeout", type=float, default=timeout, help=f"{text['timeout']} (default {timeout:g})")
    return g


@dataclass
class ClientOptions:
    """What a Client is built from; `from_args` (a parser with add_client_args) or `from_mapping` (a config
    dict: the connectors' LMCache/MP settings, fsspec kwargs), unset entries taken from the environment."""

    master: str | None = None
    node_id: str = ""
    token: str | None = None
    token_file: str | None = None
    tls_ca: str | None = None
    timeout: float = 2.0

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> ClientOptions:
        return cls(master=ns.master, node_id=ns.node_id, token=ns.token or None, token_file=ns.token_file or None,
                   tls_ca=ns.tls_ca or None, timeout=getattr(ns, "timeout", cls.timeout))

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], timeout: float = 2.0) -> ClientOptions:
        """Entries master, node_id, token, token_file, tls_ca, timeout; missing or empty ones from the
        environment (timeout: `timeout`)."""
        return cls(master=d.get("master") or envs.get("L2FS_MASTER"),
                   node_id=str(d.get("node_id") or envs.node_id()),
                   token=d.get("token") or envs.get("L2FS_TOKEN"),
                   token_file=d.get("token_file") or envs.get("L2FS_TOKEN_FILE"),
                   tls_ca=d.get("tls_ca") or envs.get("L2FS_TLS_CA"),
                   timeout=float(d["timeout"]) if d.get("timeout") is not None else timeout)

    def token_source(self) -> str | Callable[[], str] | None:
        """What Client(token=...) takes: the file (re-read per call) when there is one, else the token."""
        return FileToken(self.token_file) if self.token_file else self.token

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Client(master, **kwargs)."""
        return {"node_id": self.node_id, "token": self.token_source(), "tls_ca": self.tls_ca,
                "timeout": self.timeout}
