"""Helpers for the network-namespace tests: TCP servers and reachability probes made with sockets of the
test process that live in the cluster's namespaces (no subprocess start-up per probe), host snapshots."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from l2fs.testing.netns import NetnsCluster, NetnsError, Where, check_host

ROOT = Path(__file__).resolve().parents[2]


def require_host() -> None:
    """Skip (with the reason) unless this machine can build namespace clusters: root, ip, tc, nsenter."""
    try:
        check_host()
    except NetnsError as e:
        pytest.skip(str(e))


def echo_server(c: NetnsCluster, where: Where) -> tuple[str, int]:
    """A tiny server in the namespace, bound to its cluster address, that answers b"ok" to every
    connection; returns (addr, port). Lives as a daemon thread until the test process exits."""
    ns = c.ns(where)
    srv = c.socket(ns)
    srv.bind((ns.addr, 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"ok")

    threading.Thread(target=serve, daemon=True).start()
    return ns.addr, srv.getsockname()[1]


def reaches(c: NetnsCluster, where: Where, target: tuple[str, int], timeout: float = 1.0) -> bool:
    """Whether a TCP connection from the namespace to target completes and reads the server's b"ok"."""
    s = c.socket(where)
    s.settimeout(timeout)
    try:
        s.connect(target)
        return s.recv(2) == b"ok"
    except OSError:
        return False
    finally:
        s.close()


def wait_reaches(c: NetnsCluster, where: Where, target: tuple[str, int], timeout: float = 5.0) -> bool:
    """reaches() retried until timeout (a link just brought up needs a moment for its carrier)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reaches(c, where, target, timeout=0.5):
            return True
        time.sleep(0.1)
    return False


def host_net() -> dict[str, str]:
    """The host's own interfaces and routes (v4 and v6), to show a cluster leaves them alone."""
    out = {}
    for key, argv in {"links": ["ip", "-o", "link", "show"], "route4": ["ip", "-4", "route", "show", "table", "all"],
                      "route6": ["ip", "-6", "route", "show", "table", "all"],
                      "addrs": ["ip", "-o", "addr", "show"]}.items():
        text = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        # address lifetimes and route expiry tick down on their own (DHCP, router adverts): not ours
        out[key] = re.sub(r"(valid_lft|preferred_lft|expires) \S+", r"\1 -", text)
    return out


def wait_line(proc: subprocess.Popen[str], pattern: str, seen: list[str], timeout: float = 60) -> re.Match[str]:
    """Read the launcher's stdout until a line matches (all lines kept in seen, for the failure message)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(pattern, "".join(seen), re.S)
        if m:
            return m
    raise AssertionError(f"no {pattern!r} in the launcher's output: {''.join(seen)}")


def launch_local(tmp_path: Path, workers: int) -> subprocess.Popen[str]:
    """`l2fs local --netns` in its own session (so the test can signal its whole group)."""
    return subprocess.Popen([sys.executable, "-m", "l2fs.cli", "local", "--netns", "--workers", str(workers),
                             "--dir", str(tmp_path / "l2fs")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
