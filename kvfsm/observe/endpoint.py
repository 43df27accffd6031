"""A debug endpoint on 127.0.0.1: ``/state`` (the bounded dump of every tracker), ``/metrics``, ``/healthz``.

Served by a thread of the process that runs the trackers, for ``kvfsm top``,
a Prometheus scrape or a person with ``curl``. It binds loopback unless told
otherwise, reads trackers only through their public queries, and never holds
a tracker's lock while it writes a response.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Hashable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from .dump import state_dump

if TYPE_CHECKING:
    from ..engine import Tracker

MAX_LIMIT = 1000
"""The most instances per state ``/state?limit=N`` shows."""


class DebugServer:
    """Serves the trackers' state; ``url`` says where. Stop it with :meth:`close` (or use it as a context manager).

    ``registry`` is the Prometheus registry ``/metrics`` renders (where
    :class:`~kvfsm.observe.metrics.TrackerMetrics` registered); ``entered``
    gives, per tracker name, when each instance entered its state, so the dump
    shows ages for states without a timeout too.
    """

    def __init__(
        self,
        trackers: Mapping[str, Tracker] | Sequence[Tracker],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        registry: Any = None,
        entered: Mapping[str, Mapping[Hashable, float]] | None = None,
    ) -> None:
        self.trackers = dict(trackers) if isinstance(trackers, Mapping) else {t.spec.name: t for t in trackers}
        self.registry = registry
        self.entered = dict(entered or {})
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: a debug endpoint must not write to the serving process's stderr."""

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="kvfsm-debug", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    def state(self, limit: int = 10) -> dict[str, Any]:
        """What ``/state`` returns: every tracker's dump, by name."""
        return {
            "trackers": {
                name: state_dump(t, limit=limit, entered=self.entered.get(name)) for name, t in self.trackers.items()
            }
        }

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        url = urlparse(request.path)
        try:
            if url.path == "/state":
                query = parse_qs(url.query)
                limit = min(MAX_LIMIT, max(0, int(query.get("limit", ["10"])[0])))
                body, kind = json.dumps(self.state(limit)).encode(), "application/json"
            elif url.path == "/metrics" and self.registry is not None:
                from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                body, kind = generate_latest(self.registry), CONTENT_TYPE_LATEST
            elif url.path == "/healthz":
                body, kind = b"ok\n", "text/plain"
            else:
                request.send_error(404, "try /state, /metrics or /healthz")
                return
        except ValueError:
            request.send_error(400, "limit must be a whole number")
            return
        request.send_response(200)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> DebugServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def serve(
    trackers: Sequence[Tracker], *, host: str = "127.0.0.1", port: int = 0, state_times: bool = False
) -> DebugServer:
    """A :class:`DebugServer` for ``trackers`` with their metrics on ``/metrics`` (when prometheus_client is
    installed): what a process adds to expose its lifecycles.

    With ``state_times`` every state is timed (see :class:`~kvfsm.observe.metrics.TrackerMetrics`), and the
    dump shows ages in untimed states too; otherwise only timed states have an age (from their deadlines).
    """
    try:
        from prometheus_client import CollectorRegistry

        from .metrics import TrackerMetrics
    except ImportError:
        return DebugServer(trackers, host=host, port=port)
    registry = CollectorRegistry()
    metrics = [TrackerMetrics(t, registry=registry, state_times=state_times) for t in trackers]
    entered = {m.machine: m.entered for m in metrics} if state_times else None
    return DebugServer(trackers, host=host, port=port, registry=registry, entered=entered)
