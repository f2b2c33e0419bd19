"""The client options every l2fs caller shares: master, node id, token / token file, TLS CA, timeout.

Defined once (as Curvine's one client conf) and used by every command that talks to a master (`l2fs put|get|...`,
`l2fs mount`, `l2fs mount --passthrough`, `l2fs worker`; `kvtier router` and `kvtier lmcache-config` as
--l2fs-*), by the fsspec filesystem and by the connectors, so a flag, its environment variable (l2fs.envs) and
its default mean the same everywhere.
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


FLAGS = ("master", "node_id", "token", "token_file", "tls_ca")


def add_client_args(parser: argparse.ArgumentParser, *, timeout: float | None = 2.0,
                    help: Mapping[str, str] | None = None, prefix: str = "",  # noqa: A002
                    flags: tuple[str, ...] = FLAGS, env: bool = True,
                    aliases: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """Add --master, --node-id, --token, --token-file, --tls-ca and (unless `timeout` is None) --timeout, with
    their environment defaults. `help` overrides a flag's help where a command gives it a narrower meaning.

    A command whose own flags are not all about l2fs names them with `prefix` ("l2fs-": --l2fs-master,
    --l2fs-token, ...; read back with `ClientOptions.from_args(ns, prefix=...)`), may take only some `flags`,
    and extra option strings per flag (`aliases`, e.g. {"node_id": "--node-id"}). `env=False` is for a
    command that writes settings for another process (kvtier lmcache-config): no default from this one's
    environment, which that process does not share."""
    text = {**_HELP, **(help or {})}
    defaults = {"master": envs.get("L2FS_MASTER"), "node_id": envs.node_id(), "token": envs.get("L2FS_TOKEN"),
                "token_file": envs.get("L2FS_TOKEN_FILE"), "tls_ca": envs.get("L2FS_TLS_CA")} if env else {}
    g = parser.add_argument_group("l2fs client options")
    for name in flags:
        opts = [f"--{prefix}{name.replace('_', '-')}", *([aliases[name]] if aliases and name in aliases else [])]
        g.add_argument(*opts, dest=_dest(prefix, name), default=defaults.get(name),
                       metavar="PATH" if name == "token_file" else None, help=text[name])
    if timeout is not None:
        g.add_argument(f"--{prefix}timeout", dest=_dest(prefix, "timeout"), type=float, default=timeout,
                       help=f"{text['timeout']} (default {timeout:g})")
    return g


def _dest(prefix: str, name: str) -> str:
    return prefix.replace("-", "_") + name


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
    def from_args(cls, ns: argparse.Namespace, prefix: str = "") -> ClientOptions:
        """From a parser with add_client_args(..., prefix=prefix); flags it did not add keep their defaults."""
        def get(name: str) -> Any:
            return getattr(ns, _dest(prefix, name), None)

        return cls(master=get("master"), node_id=get("node_id") or "", token=get("token") or None,
                   token_file=get("token_file") or None, tls_ca=get("tls_ca") or None,
                   timeout=get("timeout") if get("timeout") is not None else cls.timeout)

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
