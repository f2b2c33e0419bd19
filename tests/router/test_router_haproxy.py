"""`kvtier router --data-path haproxy`: a real haproxy child carries the requests, the router picks over SPOP.

Every test runs the real haproxy (apt package) with the configuration the router renders, real test replicas and
the router process; nothing of haproxy or the router is mocked."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time

import httpx
import pytest
from router_helpers import complete, metric, wait_until

from router import spop

needs_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (.ci/install)")
HX = ("--data-path", "haproxy")


@pytest.mark.unit
@pytest.mark.parametrize("x", [0, 1, 239, 240, 241, 2287, 2288, 264431, 264432, 33818863, 33818864, 2**32 + 5])
def test_varint_round_trip_and_widths(x):
    enc = spop.enc_varint(x)
    # widths from SPOE.txt 3.1: < 240 one byte, < 2288 two, < 264432 three, < 33818864 four, then five
    width = 1 if x < 240 else 2 if x < 2288 else 3 if x < 264432 else 4 if x < 33818864 else 5
    assert len(enc) == width if x < 4328786160 else len(enc) >= 5
    assert spop.dec_varint(enc + b"\xff", 0) == (x, len(enc))


@pytest.mark.unit
def test_bad_frames_get_a_disconnect_and_the_agent_serves_on(tmp_path):
    """Malformed input on one connection: an AGENT-DISCONNECT with the error and that connection closed; the
    listener keeps serving a well-formed HELLO + NOTIFY on the next (a real asyncio unix server)."""

    async def handler(m):
        return {"seen": m["msg"]["x"]}

    async def main() -> list[bytes]:
        path = str(tmp_path / "a.sock")
        srv = await asyncio.get_running_loop().create_unix_server(lambda: spop.AgentProtocol(handler, 1024), path)
        hello = spop.frame(spop.HAPROXY_HELLO, spop.enc_kv({"supported-versions": "2.0", "max-frame-size": 16380,
                                                            "capabilities": "pipelining"}))
        notify = spop.frame(spop.NOTIFY, spop.enc_str(b"msg") + bytes((1,)) + spop.enc_kv({"x": 7}), 5, 9)
        got = []
        for data in (b"\x00\x00\x00\x03\x01\x00\x00",  # truncated metadata
                     b"\x7f\xff\xff\xff",  # over the frame size agreed
                     notify,  # NOTIFY before HELLO
                     hello + notify):  # the good exchange
            r, w = await asyncio.open_unix_connection(path)
            w.write(data)
            await w.drain()
            got.append(await asyncio.wait_for(r.read(4096) if data is not hello + notify else _two(r), 5))
            w.close()
        srv.close()
        return got

    async def _two(r: asyncio.StreamReader) -> bytes:
        out = b""
        while _frames(out, 2) is None and (chunk := await r.read(4096)):
            out += chunk
        return out

    got = asyncio.run(main())
    for g in got[:3]:
        assert g[4] == spop.AGENT_DISCONNECT, g
    frames = _frames(got[3], 2)
    assert frames[0][0] == spop.AGENT_HELLO and frames[1][0] == spop.ACK
    ack = frames[1]
    assert spop.dec_varint(ack, 5) == (5, 6) and spop.dec_varint(ack, 6) == (9, 7)  # stream and frame ids echoed
    # one set-var action: txn scope, name "seen", value uint32 7
    assert ack[7:] == bytes((spop.SET_VAR, 3, spop.SCOPE_TXN)) + spop.enc_str(b"seen") + spop.enc_typed(7)


def _frames(buf: bytes, n: int) -> list[bytes] | None:
    out, i = [], 0
    while len(out) < n:
        if len(buf) < i + 4:
            return None
        size = int.from_bytes(buf[i:i + 4], "big")
        if len(buf) < i + 4 + size:
            return None
        out.append(buf[i + 4:i + 4 + size])
        i += 4 + size
    return out


def _up(cluster, n=3, *args, replica_args=()):
    reps = [cluster.replica(*replica_args, kv=False) for _ in range(n)]
    return reps, cluster.router(reps, *HX, *args)


@needs_haproxy
def test_picks_route_by_prefix_and_end_their_accounting(cluster):
    reps, rt = _up(cluster, 3, "--strategy", "prefixaware", "--block-size", "4")
    shared = "the same long system prompt for every turn " * 8
    seen = set()
    for i in range(6):
        r = complete(rt, shared + f"question {i}")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvtier-data-path"] == "haproxy" and r.headers["x-kvtier-router-pid"]
        seen.add(r.headers["x-kvtier-replica"])
    assert len(seen) == 1  # the shared prefix keeps them on one replica
    assert r.headers["x-kvtier-route"] == "cache_hit"
    # the replica got the request id the client sees, and a stream passes through as a stream
    rid = r.headers["x-request-id"]
    home = next(p for p in reps if p.url == r.headers["x-kvtier-replica"])
    assert home.get("/admin/stats").json()["request_ids"][-1] == rid
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", rt.url + "/v1/chat/completions", json=body, timeout=30) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        chunks = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["usage"]["completion_tokens"] == 5
    # every pick was ended by haproxy's log line: nothing left in flight, each request counted by status
    wait_until(lambda: metric(rt, "kvtier_router_requests_total", code="200") == 7, timeout=5)
    assert all(x["inflight"] == 0 for x in rt.get("/health").json()["replicas"])
    # the router's own endpoints answer through haproxy; other paths and methods are not proxied
    assert rt.get("/health").status_code == 200 and rt.get("/v1/models").status_code == 200
    assert rt.get("/metrics").status_code == 200 and rt.get("/nowhere").status_code == 404
    assert rt.get("/v1/completions").status_code == 405


@needs_haproxy
def test_bad_input_auth_and_headers(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep], *HX, "--api-key", "sekret", "--upstream-api-key", "up-key", "--max-body-bytes", "20000",
                        "--haproxy-body-bytes", "4096")
    auth = {"Authorization": "Bearer sekret"}
    r = rt.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = rt.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert rep.get("/admin/stats").json()["requests"] == 0  # nothing reached the replica
    r = rt.post("/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = rt.post("/v1/completions", json={"prompt": "x"}, headers=auth)
    assert r.status_code == 400 and "'model'" in r.json()["error"]["message"]
    r = rt.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers={**auth, "X-Kvtier-Strategy": "magic"})
    assert r.status_code == 400 and "unknown strategy" in r.json()["error"]["message"]
    # over --haproxy-body-bytes: the Python data path takes it, with its own bound (--max-body-bytes)
    r = rt.post("/v1/completions", json={"model": "m", "prompt": "x" * 30_000}, headers=auth)
    assert r.status_code == 413 and r.headers["x-kvtier-data-path"] == "python"
    assert rep.get("/admin/stats").json()["requests"] == 0
    r = rt.post("/v1/completions", json={"model": "test-model", "prompt": "y" * 8000}, headers=auth)
    assert r.status_code == 200 and r.headers["x-kvtier-data-path"] == "python", r.text
    chunked = httpx.post(rt.url + "/v1/completions", headers=auth, timeout=10,  # no Content-Length: Python path
                         content=iter([b'{"model": "test-model", ', b'"prompt": "z"}']))
    assert chunked.status_code == 200 and chunked.headers["x-kvtier-data-path"] == "python"
    # a good one: the replica sees the upstream key, not the client's, and no x-kvtier-* request header
    r = complete(rt, "hello", headers={**auth, "X-Kvtier-Secret": "1", "X-Request-Id": "rid-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1" and r.headers["x-kvtier-data-path"] == "haproxy"
    seen = rep.get("/admin/stats").json()["last_headers"]
    assert seen["authorization"] == "Bearer up-key" and seen["x-request-id"] == "rid-1"
    assert not [k for k in seen if k.startswith("x-kvtier")]
    assert metric(rt, "kvtier_router_rejected_total", reason="unauthorized") == 2
    assert metric(rt, "kvtier_router_rejected_total", reason="too_large") == 1


@needs_haproxy
def test_no_open_proxying(cluster):
    """An absolute-form URI or a Host header naming another server still reaches a picked replica, never it."""
    rep = cluster.replica(kv=False)
    other = cluster.replica(kv=False)  # not behind the router
    rt = cluster.router([rep], *HX)
    host, port = rt.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "test-model", "prompt": "x"}).encode()
    for target in (f"{other.url}/v1/completions", "/v1/completions"):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST {target} HTTP/1.1\r\nHost: {other.url.removeprefix('http://')}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                      .encode() + body)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert other.get("/admin/stats").json()["requests"] == 0
    assert rep.get("/admin/stats").json()["requests"] == 2


@needs_haproxy
def test_admission_rejects_at_once_and_frees_slots(cluster):
    rep = cluster.replica("--decode-ms-per-token", "300", kv=False)
    rt = cluster.router([rep], *HX, "--max-inflight", "1", "--max-queue", "0")
    slow: list[httpx.Response] = []
    t = threading.Thread(target=lambda: slow.append(complete(rt, "slow one", max_tokens=4)))
    t.start()
    wait_until(lambda: rep.get("/admin/stats").json()["inflight"] == 1, timeout=10)
    t0 = time.monotonic()
    r = complete(rt, "second")
    took = time.monotonic() - t0
    assert r.status_code == 429 and r.headers["retry-after"] and took < 1.0, (r.status_code, took)
    t.join()
    assert slow[0].status_code == 200
    # the slot came back when haproxy logged the slow request's end
    wait_until(lambda: complete(rt, "third").status_code == 200, timeout=5)


@needs_haproxy
def test_a_failing_replica_is_marked_down_from_haproxys_log(cluster):
    reps, rt = _up(cluster, 2, "--strategy", "roundrobin", "--health-interval", "60")
    reps[0].stop()
    codes = [complete(rt, f"p{i}").status_code for i in range(6)]
    # what was sent to the dead one fails (haproxy retries the connection on the same address only); its log
    # line marks it down (no health check runs in this test's time), so every later request goes to the live one
    assert codes.count(200) >= 4 and set(codes) <= {200, 503}, codes
    up = [x["url"] for x in rt.get("/health").json()["replicas"] if x["up"]]
    assert up == [reps[1].url]
    assert all(complete(rt, f"q{i}").status_code == 200 for i in range(4))


@needs_haproxy
def test_a_stopped_picker_is_a_fast_503_not_a_hang(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep], *HX, "--queue-timeout", "0", "--max-inflight", "1", "--max-queue", "0")
    assert complete(rt, "warm").status_code == 200
    os.kill(rt.p.pid, signal.SIGSTOP)  # the router process stops answering SPOP; haproxy keeps running
    try:
        t0 = time.monotonic()
        r = httpx.post(rt.url + "/v1/completions", json={"model": "test-model", "prompt": "x"}, timeout=20)
        took = time.monotonic() - t0
    finally:
        os.kill(rt.p.pid, signal.SIGCONT)
    assert r.status_code == 503 and "picker" in r.json()["error"]["message"] and took < 5, (r.text, took)
    # the late pick (made once the router runs again) took the only slot; haproxy's log line of the 503 gives
    # it back, else every later request would be a 429
    wait_until(lambda: complete(rt, "after").status_code == 200, timeout=10)
    assert all(complete(rt, f"then {i}").status_code == 200 for i in range(3))


@needs_haproxy
def test_haproxy_and_router_live_and_die_together(cluster):
    rep = cluster.replica(kv=False)
    rt = cluster.router([rep], *HX)
    kids = subprocess.run(["pgrep", "-P", str(rt.p.pid), "haproxy"], capture_output=True, text=True).stdout.split()
    assert len(kids) == 1
    os.kill(int(kids[0]), signal.SIGKILL)  # haproxy gone: the router exits (its supervisor restarts the pod)
    rt.p.wait(timeout=15)
    rt2 = cluster.router([rep], *HX)
    kid = int(subprocess.run(["pgrep", "-P", str(rt2.p.pid), "haproxy"], capture_output=True, text=True).stdout)
    os.kill(rt2.p.pid, signal.SIGKILL)  # the router gone: haproxy does not stay behind serving nothing
    wait_until(lambda: not os.path.exists(f"/proc/{kid}") or open(f"/proc/{kid}/stat").read().split()[2] == "Z",
               timeout=10)


@needs_haproxy
def test_tls_is_terminated_by_haproxy(cluster, tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    rep = cluster.replica(kv=False)
    from router_helpers import PY, Proc, _spawn

    log = tmp_path / "router-tls.log"
    p, url = _spawn([PY, "-m", "router.cli", "--port", "0", "--replicas", rep.url, *HX, "--tls-cert", str(cert),
                     "--tls-key", str(key)], log, r"listening on (https://\S+)")
    cluster.procs.append(Proc(p, url, log))
    r = httpx.post(url + "/v1/completions", json={"model": "test-model", "prompt": "x"},
                   verify=ssl.create_default_context(cafile=str(cert)), timeout=10)
    assert r.status_code == 200 and r.headers["x-kvtier-data-path"] == "haproxy"
    with pytest.raises(httpx.HTTPError):  # plain http on the TLS port is refused
        httpx.post(url.replace("https", "http") + "/v1/completions", json={}, timeout=5).raise_for_status()


@pytest.mark.unit
def test_cli_refuses_what_haproxy_mode_cannot_do(tmp_path):
    from router import cli

    assert cli.main(["--replicas", "http://127.0.0.1:1", *HX, "--workers", "2"]) == 2
    assert cli.main(["--replicas", "http://127.0.0.1:1", *HX, "--haproxy-bin", str(tmp_path / "none")]) == 2
    if shutil.which("haproxy"):  # flag values written into haproxy's configuration stay one value
        assert cli.main(["--replicas", "http://127.0.0.1:1", "--port", "0", *HX,
                         "--upstream-api-key", 'k"\n    http-request deny']) == 2
        assert cli.main(["--replicas", "http://127.0.0.1:1", "--port", "0", *HX, "--session-header", "a b"]) == 2
