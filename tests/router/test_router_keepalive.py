"""An idle client connection outlives the client's own idle timeout, so the client always closes first.

Why: the workload bench lost a request with "Server disconnected without sending a response" 70 ms after
sending it: its session reused a connection the router (uvicorn's default keep-alive, 5 s, the same as
httpx's) closed at that moment. Behind a load balancer (AWS ALB: 60 s idle) the same race loses requests
unless the server keeps connections longer than the balancer does: `--keep-alive-timeout`, 75 s by default.
"""

from __future__ import annotations

import socket
import time

from router_helpers import Cluster


def _get(sock: socket.socket, path: str = "/health") -> bytes:
    """One HTTP/1.1 request on an open connection; the status line, or b'' when the server had closed it."""
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: router\r\n\r\n".encode())
    except OSError:
        return b""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(int(ln.split(b":", 1)[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n", 1)[0]


def _conn(url: str) -> socket.socket:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def test_an_idle_connection_stays_open_past_the_clients_timeout_and_the_flag_sets_it(cluster: Cluster) -> None:
    rep = cluster.replica(kv=False)
    default = cluster.router([rep], "--strategy", "roundrobin")
    short = cluster.router([rep], "--strategy", "roundrobin", "--keep-alive-timeout", "1")
    with _conn(default.url) as a, _conn(short.url) as b:
        assert _get(a).endswith(b"200 OK") and _get(b).endswith(b"200 OK")
        time.sleep(6.0)  # past uvicorn's and httpx's 5 s
        assert _get(a).endswith(b"200 OK")  # the same connection still serves
        assert _get(b) == b""  # --keep-alive-timeout 1: the router closed it after a second idle
