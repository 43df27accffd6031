"""Hostile peers at a listener in a process of its own: its memory stays under the documented bound, every drop is counted.

Each shape streams for a few seconds (30 with --run-slow) from raw TCP
sockets that speak just enough ZMTP 3 to pass for a PUSH peer, so they can
send what libzmq's own sockets never would: a message whose last frame never
comes, frames of any size, any number of connections. The listener runs in a
child process (this file run as a script), so the memory measured is its
own: the peak is the kernel's high-water mark (``VmHWM``), read before and
after the shape, never a sample that a loaded machine could miss.

After each shape the test drains the inbox and checks that a well-behaved
peer (a real :class:`~kvfsm.wire.Sender`) still gets a message through, that
the listener's thread and process are alive, and that what it received is
counted (``received == accepted + sum(drops)``).
"""

from __future__ import annotations

import collections
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST_SECONDS = 3.0
SLOW_SECONDS = 30.0
BOUND_CAP = 64 << 20
"""The documented bound for the default settings must itself be small: a bound of gigabytes would pass anything."""

HEADER = b"kvfsm/1"
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
"""A ZMTP 3.0 client greeting with the NULL mechanism."""


def frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    """One ZMTP frame: flags, a short or long size, the body."""
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


READY = frame(b"\x05READY" + b"\x0bSocket-Type" + (4).to_bytes(4, "big") + b"PUSH", command=True)


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("listener closed the connection")
        out += chunk
    return bytes(out)


def connect(port: int, timeout: float = 10.0) -> socket.socket | None:
    """A raw PUSH peer past the ZMTP handshake, or None if the listener refused it."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError:
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        sock.sendall(GREETING)
        _exactly(sock, 64)
        sock.sendall(READY)
        flags = _exactly(sock, 1)[0]
        size = int.from_bytes(_exactly(sock, 8 if flags & 2 else 1), "big")
        _exactly(sock, size)
    except OSError:
        sock.close()
        return None
    return sock


@dataclass
class Sent:
    """What a shape put on the wire."""

    messages: int = 0
    bytes: int = 0
    connections: int = 0
    refused: int = 0


def unfinished(port: int, deadline: float) -> Sent:
    """One message whose frames all carry MORE: its last frame never comes."""
    sent = Sent(messages=1)
    sock = connect(port)
    assert sock is not None
    sent.connections = 1
    chunk = frame(b"\x00" * 32768, more=True)
    with sock:
        sock.sendall(frame(HEADER, more=True))
        while time.monotonic() < deadline:
            sock.sendall(chunk)
            sent.bytes += len(chunk)
    return sent


def oversized(port: int, deadline: float) -> Sent:
    """Two-frame messages whose body is one 1 MiB frame (over the 64 KiB frame limit); reconnects when cut off."""
    sent = Sent()
    message = frame(HEADER, more=True) + frame(b"\x00" * (1 << 20))
    sock: socket.socket | None = None
    while time.monotonic() < deadline:
        try:
            if sock is None:
                sock = connect(port)
                sent.connections += 1
                if sock is None:
                    sent.refused += 1
                    time.sleep(0.01)
                    continue
            sock.sendall(message)
            sent.messages += 1
            sent.bytes += len(message)
        except OSError:
            if sock is not None:
                sock.close()
            sock = None
    if sock is not None:
        sock.close()
    return sent


def small_frames(port: int, deadline: float) -> Sent:
    """Messages of 1,000 one-byte frames each."""
    sent = Sent()
    message = frame(b"x", more=True) * 999 + frame(b"x")
    batch = message * 16
    sock = connect(port)
    assert sock is not None
    sent.connections = 1
    with sock:
        while time.monotonic() < deadline:
            sock.sendall(batch)
            sent.messages += 16
            sent.bytes += len(batch)
    return sent


def flood(port: int, deadline: float) -> Sent:
    """Valid messages of the largest in-memory size (256 pages, each a two-digit int), as fast as they go."""
    import msgspec

    body = msgspec.msgpack.encode(
        {"type": "metadata", "peer": "decode", "room": 7, "pages": [2**31 - 1 - i for i in range(256)]}
    )
    batch = (frame(HEADER, more=True) + frame(body)) * 64
    sent = Sent()
    sock = connect(port)
    assert sock is not None
    sent.connections = 1
    with sock:
        while time.monotonic() < deadline:
            sock.sendall(batch)
            sent.messages += 64
            sent.bytes += len(batch)
    return sent


def connections(port: int, deadline: float) -> Sent:
    """As many connections as it can hold (up to 300, the oldest closed for a new one), each in mid-message."""
    sent = Sent()
    partial = frame(HEADER, more=True) + bytes([0x02]) + (4096).to_bytes(8, "big") + b"\x00" * 4000
    held: collections.deque[socket.socket] = collections.deque()
    try:
        while time.monotonic() < deadline:
            sock = connect(port, timeout=5.0)
            sent.connections += 1
            if sock is None:
                sent.refused += 1
                if held:
                    held.popleft().close()
                time.sleep(0.002)
                continue
            try:
                sock.sendall(partial)
            except OSError:
                sock.close()
                continue
            sent.bytes += len(partial)
            sent.messages += 1
            held.append(sock)
            if len(held) >= 300:
                held.popleft().close()
            time.sleep(0.002)
    finally:
        for sock in held:
            sock.close()
    return sent


# -- the listener's process ---------------------------------------------------------


def serve(settings: dict[str, Any]) -> None:
    """The child: a listener, answering one command per line on stdin until 'quit'."""
    import msgspec

    from kvfsm.wire import Listener

    listener = Listener(**settings)
    bound = getattr(listener, "memory_bound", lambda: None)()
    print(json.dumps({"port": listener.port, "bound": bound}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "take":
            print(msgspec.json.encode(listener.take(limit=1 << 20)).decode(), flush=True)
        elif command == "drain":
            total = 0
            while batch := listener.take(limit=1 << 20):
                total += len(batch)
            print(json.dumps(total), flush=True)
        elif command == "stats":
            print(msgspec.json.encode(listener.stats()).decode(), flush=True)
        else:
            break
    listener.close()


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the kernel's peak RSS) of ``pid``, in bytes."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Child:
    """The listener's process and a line protocol to it, every read bounded in time."""

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close(), with the process)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", json.dumps(settings or {})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, cwd=ROOT, env=env,
        )  # fmt: skip
        self._buffer = b""
        hello = self._line(60.0)
        self.port: int = hello["port"]
        self.bound: int | None = hello["bound"]

    def _line(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise AssertionError(
                    f"the listener's process did not answer (exit code {self.proc.poll()}){self.log()}"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise AssertionError(f"the listener's process exited (code {self.proc.wait(10)}){self.log()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def ask(self, command: str, timeout: float = 60.0) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def log(self) -> str:
        """What the child wrote to stderr, for an assertion's message."""
        self.stderr.seek(0)
        text = self.stderr.read().decode(errors="replace")[-4000:]
        return f"\n{text}" if text else ""

    def memory(self) -> dict[str, int]:
        return _status(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.flush()
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(15)
        self.stderr.close()


def get_through(child: Child, room: int, timeout: float = 30.0) -> list[Any]:
    """Send one valid message with a real Sender until the listener's owner takes it."""
    from kvfsm.wire import AbortReq, Sender

    sender = Sender(f"tcp://127.0.0.1:{child.port}")
    deadline = time.monotonic() + timeout
    taken: list[Any] = []
    try:
        while time.monotonic() < deadline:
            sender.send(AbortReq(peer="decode", room=room))
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                taken += child.ask("take")
                if any(m.get("room") == room for m in taken):
                    return taken
                time.sleep(0.05)
    finally:
        sender.close()
    return taken


# -- the tests -----------------------------------------------------------------------

Shape = Callable[[int, float], Sent]
SHAPES: dict[str, tuple[Shape, str, str]] = {
    # name: (shape, where the drops show, the reason)
    "unfinished": (unfinished, "drops", "frames"),
    "oversized": (oversized, "drops", "oversized"),
    "small_frames": (small_frames, "drops", "frames"),
    "flood": (flood, "drops", "backlog"),
    "connections": (connections, "connection_drops", "limit"),
}


@pytest.fixture
def seconds(request: pytest.FixtureRequest) -> float:
    return SLOW_SECONDS if request.config.getoption("--run-slow") else FAST_SECONDS


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the listener's peak RSS from /proc")
@pytest.mark.parametrize("name", list(SHAPES))
def test_a_hostile_shape_stays_in_the_documented_bound_and_every_drop_is_counted(name: str, seconds: float) -> None:
    shape, table, reason = SHAPES[name]
    child = Child()
    try:
        assert get_through(child, room=1), "the listener took nothing before the shape"
        child.ask("drain")
        before = child.memory()
        start = time.monotonic()
        sent = shape(child.port, start + seconds)
        elapsed = time.monotonic() - start
        drained = child.ask("drain")
        assert get_through(child, room=2), f"a well-behaved peer got nothing through after {name}"
        after = child.memory()
        stats = child.ask("stats")
        growth = after["VmHWM"] - before["VmHWM"]
        print(
            f"\n{name}: {elapsed:.1f} s, sent {sent}, peak RSS {after['VmHWM'] / 2**20:.1f} MiB "
            f"(+{growth / 2**20:.1f} over {before['VmHWM'] / 2**20:.1f}), bound {(child.bound or 0) / 2**20:.1f} MiB, "
            f"drained {drained}, drops {stats['drops']}, connection drops {stats.get('connection_drops')}"
        )
    finally:
        child.close()
    assert child.proc.returncode == 0, f"the listener's process died (code {child.proc.returncode})"
    assert stats["alive"] and not stats["errors"] and "internal" not in stats["drops"]
    assert stats["received"] == stats["accepted"] + sum(stats["drops"].values())
    assert stats[table].get(reason, 0) >= 1, f"{name}: nothing counted as {reason!r} in {table}"
    assert child.bound is not None and child.bound <= BOUND_CAP
    assert growth <= child.bound, f"{name}: peak RSS grew {growth / 2**20:.1f} MiB, over the bound"


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(json.loads(sys.argv[2]))
