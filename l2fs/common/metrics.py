"""The Prometheus /metrics and JSON /healthz HTTP server every l2fs process runs."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# ---------- metrics / health HTTP ----------

METRICS_THREADS = 16  # requests a metrics port serves at once (one thread each); more are closed at once
METRICS_PER_IP = 4  # of them from one peer address: a scraper elsewhere still gets through
METRICS_TIMEOUT = 5.0  # seconds a request may wait for the client's next bytes (then the connection closes)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer with a bounded number of request threads, a share of them per peer address,
    and a socket timeout on each request (the handler's `timeout`).

    Why: the stock server starts a thread per connection and waits for ever for a request line; 200
    half-sent requests on a /metrics port kept 200 threads of the worker."""

    daemon_threads = True

    def __init__(self, addr: tuple[str, int], handler: Any, threads: int = METRICS_THREADS,
                 per_ip: int = METRICS_PER_IP) -> None:
        super().__init__(addr, handler)
        self._slots, self._per_ip_max = threading.BoundedSemaphore(threads), per_ip
        self._per_ip: dict[str, int] = {}
        self._ip_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        ip = str(client_address[0])
        with self._ip_lock:
            if self._per_ip.get(ip, 0) >= self._per_ip_max or not self._slots.acquire(blocking=False):
                self.shutdown_request(request)
                return
            self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(ip)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(str(client_address[0]))

    def _release(self, ip: str) -> None:
        with self._ip_lock:
            n = self._per_ip.get(ip, 1) - 1
            if n > 0:
                self._per_ip[ip] = n
            else:
                self._per_ip.pop(ip, None)
        self._slots.release()


def start_metrics_server(host: str, port: int, health: Callable[[], dict]) -> ThreadingHTTPServer:
    """Serve Prometheus /metrics and JSON /healthz on a separate HTTP port (0 = pick a free one), with
    bounded threads and a timeout per request (BoundedHTTPServer)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        timeout = METRICS_TIMEOUT

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype, code = generate_latest(), CONTENT_TYPE_LATEST, 200
            elif path in ("/healthz", "/readyz"):
                try:
                    info = health()
                    key = "ready" if path == "/readyz" else "ok"  # ready: e.g. worker registered
                    code = 200 if info.get(key, info.get("ok", True)) else 503
                except Exception as e:  # noqa: BLE001 - health must answer, never crash the server
                    info, code = {"ok": False, "error": str(e)}, 503
                body, ctype = json.dumps(info).encode(), "application/json"
            else:
                body, ctype, code = b"not found; try /metrics or /healthz\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = BoundedHTTPServer((host, port), Handler)
    threading.Thread(target=srv.serve_forever, name="l2fs-metrics", daemon=True).start()
    return srv
