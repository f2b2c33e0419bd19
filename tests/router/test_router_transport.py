"""The router's listening sockets and event loop: every accepted connection has TCP_NODELAY, and `--loop` picks
the event loop (asyncio's own by default, uvloop on request).

Why: `socket.socket()` leaves proto 0, and asyncio sets TCP_NODELAY only on connections of sockets whose proto is
IPPROTO_TCP, so the router (and the bench's test replicas) answered with Nagle on: the body of a response
written as headers, then body waited for the client's delayed ACK, ~40 ms p50 at 200 req/s on a quiet box
(docs/results/2026-12-04-router-nodelay.md).
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from router.cli import _tcp_socket, run_loop

pytestmark = pytest.mark.unit


def _accepted_nodelay(make: socket.socket) -> int:
    """TCP_NODELAY of the connection asyncio's own server accepted on `make` (bound to loopback)."""
    got: list[int] = []

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            got.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def main() -> None:
        make.bind(("127.0.0.1", 0))
        make.listen(8)
        server = await asyncio.get_running_loop().create_server(Proto, sock=make)
        _, w = await asyncio.open_connection("127.0.0.1", make.getsockname()[1])
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        w.close()
        server.close()

    asyncio.run(main())
    return got[0]


def test_accepted_connections_get_tcp_nodelay() -> None:
    assert _tcp_socket("127.0.0.1").proto == socket.IPPROTO_TCP
    assert _accepted_nodelay(_tcp_socket("127.0.0.1")) != 0
    assert _accepted_nodelay(socket.socket()) == 0  # what the router used: asyncio left Nagle on


def test_loop_flag_picks_the_event_loop() -> None:
    from router.cli import build_parser

    uvloop = pytest.importorskip("uvloop")
    seen: list[type] = []

    async def which() -> None:
        seen.append(type(asyncio.get_running_loop()))

    default = build_parser().parse_args(["--replicas", "http://a:1"]).loop
    for name in (default, "uvloop", "auto"):
        run_loop(which(), name)
    assert not issubclass(seen[0], uvloop.Loop) and seen[1] is uvloop.Loop and seen[2] is uvloop.Loop, seen
