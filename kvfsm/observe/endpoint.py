"""A debug endpoint on 127.0.0.1: ``/state`` (the bounded dump of every tracker), ``/metrics``, ``/healthz``.

Served by threads of the process that runs the trackers, for ``kvfsm top``,
a Prometheus scrape or a person with ``curl``; so whatever its clients do, it
must cost that process little and never disturb it:

- a read takes each tracker's lock once (:class:`~kvfsm.observe.view.View`),
  and an answer is reused while it is younger than ``max(fresh, its CPU
  cost / COST_SHARE)`` (``MAX_AGE`` at most): however many clients poll,
  building answers takes at most about 2% of one thread's time (and a view
  of 200,000 instances is at most a couple of seconds old);
- at most ``rate`` requests a second are answered (more wait their turn),
  so HTTP parsing cannot crowd the owner out of the GIL either;
- one selector thread holds the connections that have not sent a request
  (``max_idle`` of them, the oldest dropped first), and a fixed pool of
  ``workers`` threads answers those that have: idle clients cost no thread;
- a client must send its request within ``timeout`` seconds, every read and
  write waits at most that, and a whole exchange may last ``LIFETIME`` times it;
- nothing is written to stderr: clients that hang up, time out or are
  refused are counted in :attr:`DebugServer.counts`;
- :meth:`DebugServer.close` stops serving at once (a connection accepted
  before it is closed unanswered), joins every thread and frees the port.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import parse_qs, urlparse

from .dump import dump_view
from .stuck import limits
from .view import View

if TYPE_CHECKING:
    from ..engine import Tracker

MAX_LIMIT = 1000
"""The most instances per state ``/state?limit=N`` shows."""

COST_SHARE = 0.02
"""The most of one thread's time building answers may take: an answer is reused for 1/COST_SHARE times its cost."""

MAX_AGE = 10.0
"""Seconds an answer is reused at most, however much it cost."""

LIFETIME = 3
"""A whole exchange (request and answer) may take this many ``timeout``s; a slow sender is cut off after."""

BODIES = 8
"""Encoded ``/state`` answers kept per view, one per ``limit`` asked for."""

T = TypeVar("T")


class Reused(Generic[T]):
    """A value built by ``build`` and reused while it is younger than ``max(fresh, cost / COST_SHARE)`` (at most
    ``MAX_AGE``), its cost being the CPU time the build took.

    One build at a time: readers that find it stale while another builds wait
    for that build instead of starting their own, so a crowd of clients costs
    one build.
    """

    def __init__(self, build: Callable[[], T], fresh: float) -> None:
        self._build = build
        self._fresh = fresh
        self._lock = threading.Lock()
        self._value: T | None = None
        self._until = 0.0

    def get(self) -> T:
        with self._lock:
            if self._value is None or time.monotonic() >= self._until:
                spent = time.thread_time()  # CPU time: waiting for the tracker's lock or the GIL costs nobody
                self._value = self._build()
                spent = time.thread_time() - spent
                self._until = time.monotonic() + min(MAX_AGE, max(self._fresh, spent / COST_SHARE))
            return self._value


class Views:
    """One :class:`View` per tracker and the ``/state`` bodies already encoded from them, by ``limit``."""

    def __init__(self, views: dict[str, View]) -> None:
        self.views = views
        self.bodies: dict[int, bytes] = {}


def _named(trackers: Mapping[str, Tracker] | Sequence[Tracker]) -> dict[str, Tracker]:
    """Trackers by name: given, or the machine's, with ``[i]`` after it where one machine has several trackers."""
    if isinstance(trackers, Mapping):
        return dict(trackers)
    machines = [t.spec.name for t in trackers]
    seen: dict[str, int] = {}
    named: dict[str, Tracker] = {}
    for machine, tracker in zip(machines, trackers, strict=True):
        if machines.count(machine) == 1:
            named[machine] = tracker
        else:
            index = seen[machine] = seen.get(machine, -1) + 1
            named[f"{machine}[{index}]"] = tracker
    return named


class DebugServer:
    """Serves the trackers' state; ``url`` says where. Stop it with :meth:`close` (or use it as a context manager).

    ``trackers`` is a sequence (each named after its machine, ``machine[i]``
    where a machine has several) or a mapping of names. ``registry`` is the
    Prometheus registry ``/metrics`` renders (where
    :class:`~kvfsm.observe.metrics.TrackerMetrics` registered); ``entered``
    gives, per tracker name, when each instance entered its state, so the dump
    shows ages for states without a timeout too. ``fresh``: seconds an answer
    may be reused even when it was cheap to build. See the module docstring
    for ``workers``, ``timeout``, ``max_idle`` and ``rate``.
    """

    def __init__(
        self,
        trackers: Mapping[str, Tracker] | Sequence[Tracker],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        registry: Any = None,
        entered: Mapping[str, Mapping[Hashable, float]] | None = None,
        workers: int = 4,
        timeout: float = 5.0,
        max_idle: int = 128,
        rate: float = 20.0,
        fresh: float = 0.1,
    ) -> None:
        if workers < 1 or max_idle < 1 or not timeout > 0 or not rate > 0:
            raise ValueError(
                f"workers and max_idle must be >= 1, timeout and rate > 0 "
                f"(got workers={workers}, max_idle={max_idle}, timeout={timeout}, rate={rate})"
            )
        self.trackers = _named(trackers)
        self.limits = {name: limits(t) for name, t in self.trackers.items()}
        """Each tracker's states' deadlines and stuck thresholds, shown in ``/state`` (its params never change)."""
        self.registry = registry
        self.entered = dict(entered or {})
        self.timeout = timeout
        self.max_idle = max_idle
        self.counts: dict[str, int] = dict.fromkeys(("served", "hangups", "timeouts", "refused", "errors"), 0)
        """Connections answered, and those that hung up, timed out, were refused (too many idle) or failed (500)."""
        self._views: Reused[Views] = Reused(self._take, fresh)
        self._metrics: Reused[bytes] = Reused(self._scrape, fresh)
        self._lock = threading.Lock()
        """Guards ``counts``, ``_inflight`` and ``_closing``."""
        self._closing = False
        self._inflight: dict[socket.socket, float] = {}
        """Connections a worker is answering → when they must be done (the selector cuts them then)."""
        self._jobs: queue.SimpleQueue[socket.socket | None] = queue.SimpleQueue()
        self._workers = workers
        self._busy = 0
        """Connections handed to the pool and not yet done with: the selector hands over no more than ``workers``."""
        self._rate = rate
        self._tokens = float(workers)
        self._filled = time.monotonic()
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        self._address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)  # a full wake-up pipe already says "wake up"
        self._handler = _handler(self)
        self._threads = [threading.Thread(target=self._select, name="kvfsm-debug", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"kvfsm-debug-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def url(self) -> str:
        host, port = self._address
        return f"http://{host}:{port}"

    # -- answers ------------------------------------------------------------------------------------

    def state(self, limit: int = 10) -> dict[str, Any]:
        """What ``/state`` returns, read now: every tracker's dump, by name."""
        return self._document(self._take(), limit)

    def _take(self) -> Views:
        return Views({name: View.take(t, self.entered.get(name)) for name, t in self.trackers.items()})

    def _scrape(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def _document(self, views: Views, limit: int) -> dict[str, Any]:
        return {
            "trackers": {
                name: dump_view(view, limit=limit, limits=self.limits.get(name)) for name, view in views.views.items()
            }
        }

    def _state_body(self, limit: int) -> bytes:
        views = self._views.get()
        body = views.bodies.get(limit)
        if body is None:
            body = json.dumps(self._document(views, limit)).encode()
            if len(views.bodies) < BODIES:
                views.bodies[limit] = body
        return body

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        url = urlparse(request.path)
        try:
            if url.path == "/state":
                try:
                    limit = min(MAX_LIMIT, max(0, int(parse_qs(url.query).get("limit", ["10"])[0])))
                except ValueError:
                    request.send_error(400, "limit must be a whole number")
                    return
                body, kind = self._state_body(limit), "application/json"
            elif url.path == "/metrics" and self.registry is not None:
                from prometheus_client import CONTENT_TYPE_LATEST

                body, kind = self._metrics.get(), CONTENT_TYPE_LATEST
            elif url.path == "/healthz":
                body, kind = b"ok\n", "text/plain"
            else:
                request.send_error(404, "try /state, /metrics or /healthz")
                return
        except Exception:  # a tracker or collector that fails: the client hears it, stderr does not
            self._count("errors")
            request.send_error(500, "the state could not be read")
            return
        request.send_response(200)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)
        self._count("served")

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    # -- connections --------------------------------------------------------------------------------

    def _select(self) -> None:
        """Accept connections, hold them until they send a request, and hand them to the pool at ``rate`` at most.

        ``waiting`` holds connections that have sent nothing yet, ``ready``
        those that have and wait for a worker; each is dropped at its
        deadline, and the oldest go first when there are more than ``max_idle``.
        """
        waiting: dict[socket.socket, float] = {}  # registered; deadlines in accept order
        ready: dict[socket.socket, float] = {}  # unregistered; deadlines in arrival order
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closing:
                for key, _events in selector.select(self._wait(waiting, ready)):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._listener:
                        self._accept(selector, waiting)
                    elif sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            sock.recv(4096)
                    elif sock in waiting:  # not one dropped earlier in this batch
                        selector.unregister(sock)
                        del waiting[sock]
                        ready[sock] = time.monotonic() + self.timeout
                now = time.monotonic()
                while ready and self._busy < self._workers and self._token(now):
                    sock = next(iter(ready))
                    del ready[sock]
                    with self._lock:
                        self._busy += 1
                    self._jobs.put(sock)
                for held, why in ((waiting, "timeouts"), (ready, "refused")):
                    while held and next(iter(held.values())) <= now:
                        self._drop(selector, held, next(iter(held)), why)
                while len(waiting) + len(ready) > self.max_idle:
                    held = waiting if waiting else ready
                    self._drop(selector, held, next(iter(held)), "refused")
                self._cut_overdue(now)
            for held in (waiting, ready):
                while held:
                    self._drop(selector, held, next(iter(held)), None)
        self._listener.close()

    def _wait(self, waiting: dict[socket.socket, float], ready: dict[socket.socket, float]) -> float:
        """How long the selector may sleep: until the next deadline, token or overdue check."""
        now, wait = time.monotonic(), min(0.25, self.timeout / 2)
        for held in (waiting, ready):
            if held:
                wait = min(wait, next(iter(held.values())) - now)
        if ready and self._busy < self._workers and self._tokens < 1:
            wait = min(wait, (1 - self._tokens) / self._rate)
        return max(0.0, wait)

    def _token(self, now: float) -> bool:
        """Take one of the answers ``rate`` allows (a bucket of ``workers`` tokens, refilled at ``rate`` a second)."""
        if self._rate == math.inf:
            return True
        self._tokens = min(float(self._workers), self._tokens + (now - self._filled) * self._rate)
        self._filled = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _accept(self, selector: selectors.BaseSelector, waiting: dict[socket.socket, float]) -> None:
        while True:
            try:
                sock, _address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or a connection reset before it was accepted
                self._count("refused")
                return
            waiting[sock] = time.monotonic() + self.timeout
            selector.register(sock, selectors.EVENT_READ)

    def _drop(
        self, selector: selectors.BaseSelector, held: dict[socket.socket, float], sock: socket.socket, why: str | None
    ) -> None:
        with contextlib.suppress(KeyError):
            selector.unregister(sock)  # ready ones are unregistered already
        del held[sock]
        sock.close()
        if why is not None:
            self._count(why)

    def _cut_overdue(self, now: float) -> None:
        """Shut down connections a worker has been answering for too long: the worker's read or write then ends."""
        with self._lock:
            overdue = [sock for sock, until in self._inflight.items() if until <= now]
            for sock in overdue:
                self._inflight[sock] = math.inf  # cut once, counted once
                self.counts["timeouts"] += 1
        for sock in overdue:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _work(self) -> None:
        """A worker: answer one connection at a time until ``close`` sends None."""
        while (sock := self._jobs.get()) is not None:
            with self._lock:
                closing = self._closing
                if not closing:
                    self._inflight[sock] = time.monotonic() + LIFETIME * self.timeout
            try:
                if not closing:
                    self._handler(sock, sock.getpeername(), self)
            except TimeoutError:
                self._count("timeouts")
            except OSError:  # the client hung up (reset, broken pipe) or close() cut it: counted, never printed
                if not self._closing:
                    self._count("hangups")
            except Exception:
                self._count("errors")
            finally:
                with self._lock:
                    self._inflight.pop(sock, None)
                    self._busy -= 1
                sock.close()
                with contextlib.suppress(OSError):
                    self._wake_w.send(b"x")  # a worker is free: the selector may hand it the next

    def close(self) -> None:
        """Stop serving: close the port and every connection (answered or not), and join every thread."""
        with self._lock:
            if self._closing:
                return
            self._address = self._listener.getsockname()[:2]
            self._closing = True
            inflight = list(self._inflight)
        for sock in inflight:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        for _ in self._threads[1:]:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=LIFETIME * self.timeout)
        while True:  # connections handed to the pool after its workers left
            try:
                left = self._jobs.get_nowait()
            except queue.Empty:
                break
            if left is not None:
                left.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> DebugServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _handler(server: DebugServer) -> Callable[[socket.socket, Any, Any], object]:
    """The request handler class: HTTP/1.0 (one request per connection), reads and writes bounded by ``timeout``."""

    class Handler(BaseHTTPRequestHandler):
        timeout = server.timeout

        def do_GET(self) -> None:
            server._answer(self)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: a debug endpoint must not write to the serving process's stderr."""

        def log_error(self, format: str, *args: Any) -> None:
            """Quiet too; a read that timed out (the only error the base class swallows) is counted."""
            if any(isinstance(arg, TimeoutError) for arg in args):
                server._count("timeouts")

    return Handler


def serve(
    trackers: Mapping[str, Tracker] | Sequence[Tracker],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    state_times: bool = False,
) -> DebugServer:
    """A :class:`DebugServer` for ``trackers`` with their metrics on ``/metrics`` (when prometheus_client is
    installed): what a process adds to expose its lifecycles.

    Trackers are named as :class:`DebugServer` names them; where a machine
    has several, each one's series carry its name as a ``tracker`` label
    (a machine with one tracker keeps the labels it always had). With
    ``state_times`` every state is timed (see
    :class:`~kvfsm.observe.metrics.TrackerMetrics`), and the dump shows ages in
    untimed states too; otherwise only timed states have an age (from their deadlines).
    """
    named = _named(trackers)
    try:
        from prometheus_client import CollectorRegistry

        from .metrics import TrackerMetrics
    except ImportError:
        return DebugServer(named, host=host, port=port)
    machines = [t.spec.name for t in named.values()]
    registry = CollectorRegistry()
    metrics = {
        name: TrackerMetrics(
            t,
            registry=registry,
            state_times=state_times,
            name=name if machines.count(t.spec.name) > 1 else None,
        )
        for name, t in named.items()
    }
    entered = {name: m.entered for name, m in metrics.items()} if state_times else None
    return DebugServer(named, host=host, port=port, registry=registry, entered=entered)
