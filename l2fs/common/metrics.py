"""The Prometheus /metrics and JSON /healthz HTTP server every l2fs process runs."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# ---------- metrics / health HTTP ----------

def start_metrics_server(host: str, port: int, health: Callable[[], dict]) -> ThreadingHTTPServer:
    """Serve Prometheus /metrics and JSON /healthz on a separate HTTP port (0 = pick a free one)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
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

    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="l2fs-metrics", daemon=True).start()
    return srv
