"""Addresses and ports: master lists, shard specs, host:port checks, free ports and port files."""

from __future__ import annotations

import json
import os
import random
import re
import socket
from pathlib import Path
from typing import Any


def parse_masters(spec: str) -> list[list[str]]:
    """'m0a:p,m0b:p;m1:p' -> [['m0a:p', 'm0b:p'], ['m1:p']]: ';' separates shards (each its own namespace
    slice), ',' the failover addresses of one shard. A spec without ';' is one shard, as before."""
    shards = [[a.strip() for a in part.split(",") if a.strip()] for part in (spec or "").split(";")]
    if not shards or any(not s for s in shards):
        raise ValueError(f"bad l2fs master list {spec!r}: want host:port[,host:port][;host:port...] "
                         f"(';' between shards, ',' between one shard's failover masters)")
    return shards


def parse_shard(spec: str) -> tuple[int, int]:
    """'1/2' -> (1, 2): this master's shard index and the shard count (`l2fs master --shard`)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec or "")
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"bad shard {spec!r}: want INDEX/COUNT with 0 <= INDEX < COUNT, e.g. 0/2")
    return int(m.group(1)), int(m.group(2))


_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,252}[A-Za-z0-9])?):(\d{1,5})$")


def valid_address(addr: str) -> bool:
    """host:port with a DNS name, IPv4 or [IPv6] host and a port in 1..65535."""
    m = _HOSTPORT.match(addr or "")
    return m is not None and 0 < int(m.group(2)) < 65536


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_NAMED_PORTS_FROM = 15000  # lowest port free_port hands out; below it sit well-known services' defaults
_random = random.SystemRandom()


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range for bind(0) and outgoing connections, (low, high), or None where it cannot be read."""
    try:
        lo, hi = (int(x) for x in Path(_EPHEMERAL_RANGE).read_text().split())
    except (OSError, ValueError):
        return None
    return lo, hi


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for launchers and tests that must name a port up front).

    Drawn at random below the kernel's ephemeral range when there is room: a port from bind(0) is one the
    kernel may also give any process's next outgoing connection before our server binds it (the likeliest
    cause of a CI run's vLLM replica dying at engine start), and a random draw keeps parallel test workers
    apart. Falls back to bind(0) where the range is unknown or leaves no room below it.
    """
    rng = ephemeral_range()
    if rng and rng[0] - _NAMED_PORTS_FROM >= 1000:
        for _ in range(64):
            port = _random.randrange(_NAMED_PORTS_FROM, rng[0])
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_port_file(path: str | None, **info: Any) -> None:
    """Atomically write bound ports as JSON so launchers using --port 0 can find them."""
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps(info))
    os.replace(tmp, path)
