"""Launch helpers every test and bench leans on: ports named up front and start failures that say why."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from l2fs import procs
from l2fs.common import free_port, net

pytestmark = pytest.mark.unit


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    """A named port must not come from the range the kernel gives outgoing connections: a client socket can
    take it between free_port and the server's bind."""
    rng = net.ephemeral_range()
    if rng is None or rng[0] < 16000:
        pytest.skip(f"ephemeral range {rng} leaves no room below it")
    ports = {free_port() for _ in range(50)}
    assert all(1024 < p < rng[0] for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random, so parallel workers rarely pick the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_free_port_skips_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken])
        monkeypatch.setattr(net._random, "randrange", lambda lo, hi: next(draws, lo + 7))
        monkeypatch.setattr(net, "ephemeral_range", lambda: (taken + 100, 60999))
        monkeypatch.setattr(net, "_NAMED_PORTS_FROM", min(taken - 1000, 15000))
        port = free_port()
    assert port != taken


def test_free_port_falls_back_to_the_kernel_without_a_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net, "_EPHEMERAL_RANGE", "/nonexistent/ip_local_port_range")
    assert net.ephemeral_range() is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_a_failed_start_names_the_root_cause_the_tail_scrolled_past(tmp_path: Path) -> None:
    """vLLM prints the engine core's exception first and 'Engine core initialization failed. See root cause
    above' last; the error must carry the first one even when 40 lines of traceback lie between them."""
    script = ("import sys\n"
              "print('zmq.error.ZMQError: Address already in use (addr=\\'tcp://*:45863\\')')\n"
              "for i in range(80): print(f'  File \"x.py\", line {i}')\n"
              "print('RuntimeError: Engine core initialization failed. See root cause above.')\n"
              "sys.exit(1)\n")
    log = tmp_path / "server.log"
    proc = procs.spawn([sys.executable, "-c", script], log)
    try:
        with pytest.raises(procs.ProcessError) as err:
            procs.wait_ready(proc, lambda: None, timeout=60, what="server", log_path=log, interval=0.05)
    finally:
        procs.stop(proc)
    msg = str(err.value)
    assert "Address already in use" in msg and "Engine core initialization failed" in msg
    assert msg.count("earlier in the log") == 1


def test_tail_without_a_hidden_cause_is_the_plain_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("ValueError: shown in the tail\nok\n")
    assert procs.tail(log) == "ValueError: shown in the tail\nok"
    assert procs.tail(tmp_path / "missing.log") == "(no log)"
