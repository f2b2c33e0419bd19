"""Router access control: no open proxy, and the API key is enforced (real router + test replica processes).

A canary HTTP server that is NOT one of the router's replicas records every request it gets; no trick a
client can play (absolute-form targets, CONNECT, Host / X-Forwarded-* headers, URLs in the path or body)
may make the router talk to it. With --api-key, requests without the right bearer token are refused
with 401 before anything reaches a replica.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from router_helpers import ROOT, Cluster, metric  # noqa: E402

KEY = "router-key-for-tests"


class Canary:
    """An HTTP server that answers anything with 200 and records the request line."""

    def __init__(self) -> None:
        seen: list[str] = []
        self.seen = seen

        class H(BaseHTTPRequestHandler):
            def _any(self) -> None:
                seen.append(f"{self.command} {self.path}")
                body = b'{"canary": true}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_CONNECT = _any  # noqa: N815

            def log_message(self, *a: Any) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    cluster = Cluster(tmp_path)
    canary = Canary()
    try:
        rep = cluster.replica(kv=False)
        router = cluster.router([rep], "--api-key", KEY)
        yield router, rep, canary
    finally:
        cluster.close()
        canary.close()


def _raw(url: str, request: bytes) -> bytes:
    """Send a hand-written HTTP/1.1 request (httpx cannot send absolute-form targets or CONNECT)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_router_is_not_an_open_proxy(setup: Any) -> None:
    router, rep, canary = setup
    auth = {"Authorization": f"Bearer {KEY}"}
    hostport = f"127.0.0.1:{canary.port}"
    body = b'{"model": "test-model", "prompt": "hi", "max_tokens": 1}'
    raw = [
        f"GET {canary.url}/v1/models HTTP/1.1\r\nHost: {hostport}\r\nAuthorization: Bearer {KEY}\r\n\r\n",
        f"POST {canary.url}/v1/completions HTTP/1.1\r\nHost: {hostport}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body.decode()}",
        f"CONNECT {hostport} HTTP/1.1\r\nHost: {hostport}\r\nAuthorization: Bearer {KEY}\r\n\r\n",
    ]
    for req in raw:
        _raw(router.url, req.encode())
    with httpx.Client(timeout=15) as c:
        tricks = [
            ("POST", "/v1/completions", {"Host": hostport}, {}),
            ("POST", "/v1/completions", {"X-Forwarded-Host": hostport, "X-Forwarded-Proto": "http",
                                         "Forwarded": f"host={hostport}"}, {}),
            ("POST", "/v1/completions", {"X-Kvtier-Replica": canary.url, "X-Kvtier-Upstream": canary.url,
                                         "X-Kvtier-Strategy": canary.url}, {}),
            ("POST", "/v1/completions", {}, {"base_url": canary.url, "replica": canary.url, "url": canary.url,
                                             "model": canary.url}),
            ("POST", "/v1/chat/completions", {}, {"messages": [{"role": "user", "content": "x"}],
                                                  "api_base": canary.url}),
            ("GET", f"/{canary.url}/v1/models", {}, None),
            ("GET", f"//{hostport}/v1/models", {}, None),
            ("POST", f"/v1/completions/../../{hostport}/v1/completions", {}, {}),
            ("GET", f"/v1/models?url={canary.url}", {}, None),
        ]
        for method, path, headers, extra in tricks:
            payload = {"model": "test-model", "prompt": "hello", "max_tokens": 1, **(extra or {})}
            r = c.request(method, router.url + path, headers={**auth, **headers},
                          json=payload if extra is not None else None)
            assert r.status_code < 500 or r.status_code in (502, 503), (path, r.status_code, r.text[:200])
        # The router still serves the configured replica normally.
        ok = c.post(router.url + "/v1/completions", headers=auth,
                    json={"model": "test-model", "prompt": "hello", "max_tokens": 1})
        assert ok.status_code == 200, ok.text[:300]
        assert "canary" not in ok.text
    assert canary.seen == [], f"the router forwarded to a host that is not a replica: {canary.seen}"


def test_router_api_key_enforced(setup: Any) -> None:
    router, rep, canary = setup
    body = {"model": "test-model", "prompt": "hello", "max_tokens": 1}
    chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                   {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                   {"X-Api-Key": KEY}]
    before = metric(router, "kvtier_router_requests_total")
    denied0 = metric(router, "kvtier_router_rejected_total", reason="unauthorized")
    with httpx.Client(timeout=15) as c:
        for h in bad_headers:
            for path, js in (("/v1/completions", body), ("/v1/chat/completions", chat)):
                r = c.post(router.url + path, headers=h, json=js)
                assert r.status_code == 401, (path, h, r.status_code, r.text[:200])
                assert r.json().get("error"), r.text
            r = c.get(router.url + "/v1/models", headers=h)
            assert r.status_code == 401, ("/v1/models", h, r.status_code)
        good = {"Authorization": f"Bearer {KEY}"}
        assert c.post(router.url + "/v1/completions", headers=good, json=body).status_code == 200
        assert c.get(router.url + "/v1/models", headers=good).status_code == 200
    # Every refused request was counted as such, and only the authorised ones reached the proxy path.
    assert metric(router, "kvtier_router_rejected_total", reason="unauthorized") - denied0 == 3 * len(bad_headers)
    assert metric(router, "kvtier_router_requests_total") - before <= 2


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
_VALID = {"model": "test-model", "prompt": "hello", "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 1}
_BODIES = st.one_of(
    # A valid request with one field replaced by anything: reaches tokenization, routing and the replica.
    st.tuples(st.sampled_from(["model", "prompt", "messages", "stream", "temperature", "user", "n"]), _JSONISH).map(
        lambda kv: json.dumps({**_VALID, kv[0]: kv[1]}).encode()),
    st.binary(max_size=300),
    _JSONISH.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={"model": _JSONISH, "prompt": _JSONISH, "messages": _JSONISH,
                                        "max_tokens": _JSONISH, "stream": _JSONISH}).map(
        lambda d: json.dumps(d).encode()),
)


def test_router_http_fuzz(setup: Any) -> None:
    """Random bodies, JSON shapes and content types at the router's endpoints: it answers each with a
    deliberate status (never 500), and keeps serving real requests."""
    router, _rep, _canary = setup
    auth = {"Authorization": f"Bearer {KEY}"}
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=30) as c:

        @settings(max_examples=120, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        @given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), _BODIES,
               st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))
        def run(path: str, body: bytes, ctype: str) -> None:
            r = c.post(router.url + path, content=body, headers={**auth, "Content-Type": ctype})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code != 500 and r.status_code < 600, (path, body[:200], r.status_code, r.text[:200])
            if r.status_code >= 400:
                assert r.text, "error without a message"

        run()
        assert c.get(router.url + "/health").status_code == 200
        ok = c.post(router.url + "/v1/completions", headers=auth,
                    json={"model": "test-model", "prompt": "hello", "max_tokens": 1})
        assert ok.status_code == 200, ok.text[:300]
    print(f"router fuzz statuses: {dict(sorted(statuses.items()))}")


def test_router_tls_refuses_plain_http(tmp_path: Path) -> None:
    """With --tls-cert/--tls-key the router speaks only HTTPS: plain HTTP gets no HTTP answer, an
    untrusted CA fails the handshake, and HTTPS still enforces the API key and proxies to the replica."""
    import trustme
    from router_helpers import PY, Proc, _spawn

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    cluster = Cluster(tmp_path)
    try:
        rep = cluster.replica(kv=False)
        p, url = _spawn([PY, "-m", "router.cli", "--port", "0", "--replicas", rep.url, "--api-key", KEY,
                         "--tls-cert", str(tmp_path / "tls.crt"), "--tls-key", str(tmp_path / "tls.key")],
                        tmp_path / "router-tls.log", r"listening on (https://\S+)")
        cluster.procs.append(Proc(p, url, tmp_path / "router-tls.log"))
        body = {"model": "test-model", "prompt": "hello", "max_tokens": 1}
        good = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=15, verify=ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))) as c:
            for _ in range(100):  # answered once the app has started
                try:
                    if c.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            assert c.post(url + "/v1/completions", json=body).status_code == 401
            r = c.post(url + "/v1/completions", headers=good, json=body)
            assert r.status_code == 200, r.text[:300]
            assert r.json()["choices"], r.text[:300]
        # Plain HTTP on the same port: no HTTP response, whatever the request carries.
        plain = url.replace("https://", "http://")
        with pytest.raises(httpx.TransportError):
            httpx.post(plain + "/v1/completions", headers=good, json=body, timeout=5)
        raw = _raw(plain, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert not raw.startswith(b"HTTP/"), raw[:100]
        with pytest.raises(httpx.ConnectError):  # a CA the client does not trust fails the handshake
            httpx.get(url + "/health", timeout=5)
        # Only one of --tls-cert/--tls-key, or an unreadable pair, is a clear startup error.
        for args, msg in ((["--tls-cert", str(tmp_path / "tls.crt")], "go together"),
                          (["--tls-cert", str(tmp_path / "tls.key"), "--tls-key", str(tmp_path / "tls.crt")],
                           "cannot load TLS")):
            r2 = subprocess.run([PY, "-m", "router.cli", "--port", "0", "--replicas", rep.url, *args],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
            assert r2.returncode == 2 and msg in r2.stderr, (r2.returncode, r2.stderr[-500:])
    finally:
        cluster.close()
