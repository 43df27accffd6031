"""The inspect page served on loopback: ``/`` is the page, ``/live`` the live view's next reading.

Bound to 127.0.0.1 only, no account: anyone who can reach it is on this
machine. A request whose Host is not this address is refused, so a web page
elsewhere cannot read a tracker's state through a DNS name rebound to
127.0.0.1. Nothing is logged per request.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .live import Watch

HOST = "127.0.0.1"


class InspectServer:
    """Serves ``page`` (one HTML document) and, with ``watch``, its live readings; :meth:`close` stops it."""

    def __init__(self, page: str, *, port: int = 0, watch: Watch | None = None) -> None:
        body = page.encode("utf-8")
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.headers.get("Host", "") not in owner.hosts:
                    self._send(421, b"kvfsm inspect answers only on its own loopback address\n", "text/plain")
                elif self.path in ("/", "/index.html") or self.path.startswith("/#"):
                    self._send(200, body, "text/html; charset=utf-8")
                elif self.path == "/live" and watch is not None:
                    self._send(200, json.dumps(watch.read()).encode(), "application/json")
                else:
                    self._send(404, b"not here: try /\n", "text/plain")

            def _send(self, code: int, data: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((HOST, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://{HOST}:{self.port}/"
        self.hosts = frozenset({f"{HOST}:{self.port}", f"localhost:{self.port}"})
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`close` (from another thread) or a KeyboardInterrupt."""
        self._server.serve_forever(poll_interval=0.2)

    def start(self) -> InspectServer:
        """Serve from a thread of its own (tests, a notebook)."""
        self._thread = threading.Thread(target=self.serve_forever, name="kvfsm-inspect", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and free the port."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> InspectServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
