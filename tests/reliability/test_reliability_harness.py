"""The fault-injection harness itself: if these helpers were wrong, the fault tests would prove nothing."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from reliability_faults import (
    FaultProxy,
    alive,
    check_payload,
    find_block_files,
    flip_bit,
    lru_hit_rate,
    payload,
    percentile,
    stopped,
    truncate,
    zipf_trace,
)


def test_payload_detects_flips_tears_and_mixes() -> None:
    a, b = payload(1, 4096, "/k"), payload(2, 4096, "/k")
    assert check_payload(a, 4096, "/k") == 1 and check_payload(b, 4096, "/k") == 2
    assert a != payload(1, 4096, "/other")  # the key is part of the pattern: no cross-key confusion
    flipped = bytearray(a)
    flipped[3000] ^= 0x10
    torn = a[:2048] + b[2048:]
    for bad in (bytes(flipped), torn, a[:-1], a + b"\0", None):
        with pytest.raises(AssertionError):
            check_payload(bad, 4096, "/k")


def test_find_flip_truncate_on_disk(tmp_path: Path) -> None:
    data = payload(3, 8192, "/x")
    (tmp_path / "sub").mkdir()
    target = tmp_path / "sub" / "blk"
    target.write_bytes(b"HDR" + data)
    (tmp_path / "other").write_bytes(payload(4, 8192, "/x"))
    assert find_block_files([tmp_path], data[5000:5064]) == [target]
    off = flip_bit(target)
    assert target.read_bytes()[off] != (b"HDR" + data)[off]
    assert truncate(target, 10) == 10 and target.stat().st_size == 10


def test_lru_baseline_on_known_traces() -> None:
    one = lambda _k: 1  # noqa: E731
    # Capacity 2, trace a b a c b: hits only on the second a -> 1/5 (c evicts b, so b misses).
    assert lru_hit_rate([0, 1, 0, 2, 1], 2, one) == pytest.approx(1 / 5)
    assert lru_hit_rate([0, 0, 0, 0], 1, one) == pytest.approx(3 / 4)
    assert lru_hit_rate([0, 1, 2, 0, 1, 2], 2, one) == 0.0  # the classic LRU loop pathology
    trace = zipf_trace(100, 5000, s=1.0, seed=1)
    assert trace == zipf_trace(100, 5000, s=1.0, seed=1)
    small, big = lru_hit_rate(trace, 10, one), lru_hit_rate(trace, 50, one)
    assert 0 < small < big < 1


def test_percentile_nearest_rank() -> None:
    v = [float(i) for i in range(1, 101)]
    assert percentile(v, 50) == 50.0 and percentile(v, 99) == 99.0 and percentile(v, 100) == 100.0
    assert percentile([], 99) == 0.0


def test_sigstop_freezes_and_resumes_a_process() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: print(time.time(), flush=True); time.sleep(0.02)"],
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        p.stdout.readline()
        with stopped(p.pid):
            time.sleep(0.2)
            with open(f"/proc/{p.pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "T"
        p.stdout.readline()
        assert alive(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not alive(p.pid)


def _echo(c: socket.socket) -> None:
    try:
        while data := c.recv(4096):
            c.sendall(data)
    except OSError:
        pass  # the proxy reset us: that is the point of the test


def _echo_server() -> tuple[socket.socket, str]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"127.0.0.1:{srv.getsockname()[1]}"


def test_fault_proxy_pass_drop_blackhole() -> None:
    srv, target = _echo_server()
    with FaultProxy(target) as proxy:
        host, port = proxy.address.split(":")
        s = socket.create_connection((host, int(port)), timeout=2)
        s.sendall(b"ping")
        assert s.recv(4) == b"ping"
        proxy.set_mode("drop")
        try:
            got = s.recv(1)  # a dropped connection: RST (error) or at least EOF, never data
        except OSError:
            got = b""
        assert got == b""
        proxy.set_mode("blackhole")
        s2 = socket.create_connection((host, int(port)), timeout=0.3)
        s2.sendall(b"hello")
        with pytest.raises(TimeoutError):
            s2.recv(5)
        s2.close()
    srv.close()
