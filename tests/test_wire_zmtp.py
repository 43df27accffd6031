"""The listener's own ZMTP: it parses a stream however it is cut, refuses what is not a ZMTP 3 NULL PUSH peer, and its inbox budget counts enough.

The hostile shapes (test_wire_hostile.py) show the memory bound holds under
load; these pin the pieces it rests on: a message judged as soon as it is
certain to be dropped, handshake refusals counted, and
:func:`~kvfsm.wire.listener.message_cost` never under what a message holds.
"""

from __future__ import annotations

import socket
import time
import tracemalloc

import msgspec
import pytest
from test_wire_hostile import GREETING, HEADER, READY, connect, frame

from kvfsm.wire import AbortReq, Hello, Listener, Metadata, decode
from kvfsm.wire.listener import message_cost
from kvfsm.wire.zmtp import HELLO, Session, ZmtpError, command


class Recorder:
    """A session's sink that keeps what it was handed."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def dropped(self, reason: str) -> None:
        self.events.append(reason)

    def complete(self, header: bytes, body: bytes) -> None:
        self.events.append(decode([header, body]))


GOOD = [HEADER, msgspec.msgpack.encode(AbortReq(peer="decode", room=5))]
STREAM = (
    GREETING + READY
    + frame(GOOD[0], more=True) + frame(GOOD[1])  # taken
    + frame(HEADER)  # one frame
    + frame(HEADER, more=True) + frame(GOOD[1], more=True) + frame(b"x")  # three frames
    + frame(b"kvfsm/9", more=True) + frame(GOOD[1])  # another version
    + frame(b"k" * 40, more=True) + frame(GOOD[1])  # frame 0 longer than any header
    + frame(HEADER, more=True) + frame(b"\x00" * 5000)  # body over MAX_BODY
    + frame(HEADER, more=True) + frame(b"\x00" * 70000)  # frame over max_frame
    + command(b"PING", {})  # a command between messages is skipped
    + frame(GOOD[0], more=True) + frame(GOOD[1])
)  # fmt: skip
EXPECTED = [decode(GOOD), "frames", "frames", "version", "header", "oversized", "oversized", decode(GOOD)]


@pytest.mark.parametrize("cut", [1, 7, 64, 4096, len(STREAM)])
def test_a_stream_gives_the_same_messages_and_drops_however_it_is_cut(cut: int) -> None:
    sink = Recorder()
    session = Session(sink, max_frame=64 << 10)
    for i in range(0, len(STREAM), cut):
        session.feed(memoryview(STREAM[i : i + cut]))
    assert session.ready and not session.in_message
    assert sink.events == EXPECTED


def test_a_message_is_judged_before_its_last_frame_comes() -> None:
    sink = Recorder()
    session = Session(sink, max_frame=64 << 10)
    session.feed(
        memoryview(GREETING + READY + frame(HEADER, more=True) + frame(b"x", more=True) + frame(b"y", more=True))
    )
    assert sink.events == ["frames"] and session.in_message


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (b"GET / HTTP/1.1\r\n", "handshake"),
        (GREETING[:10] + b"\x02", "handshake"),  # ZMTP 2
        (GREETING[:12] + b"CURVE".ljust(20, b"\x00") + GREETING[32:], "handshake"),
        (GREETING + frame(b"x"), "handshake"),  # a message before READY
        (GREETING + command(b"READY", {b"Socket-Type": b"PUB"}), "handshake"),
        (GREETING + command(b"ERROR", {}), "handshake"),
        (GREETING + READY + b"\x08\x01x", "protocol"),  # a reserved flag bit
        (GREETING + READY + frame(HEADER, more=True) + command(b"PING", {}), "protocol"),
    ],
)
def test_what_is_not_a_zmtp3_null_push_peer_is_refused(stream: bytes, reason: str) -> None:
    with pytest.raises(ZmtpError) as info:
        Session(Recorder(), max_frame=64 << 10).feed(memoryview(stream))
    assert info.value.reason == reason


def wait_for(listener: Listener, key: str, timeout: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while key not in listener.stats().connection_drops and time.monotonic() < deadline:
        time.sleep(0.01)
    return listener.stats().connection_drops


def test_a_live_listener_counts_refused_handshakes_and_silent_peers() -> None:
    with Listener(handshake_timeout=0.3) as listener:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as silent:
            assert silent.recv(len(HELLO), socket.MSG_WAITALL) == HELLO
            assert wait_for(listener, "handshake") == {"handshake": 1}
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as http:
            http.sendall(b"GET / HTTP/1.1\r\n\r\n")
            deadline = time.monotonic() + 10
            while listener.stats().connection_drops.get("handshake", 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert listener.stats().connection_drops == {"handshake": 2} and listener.stats().connections == 0


def test_connections_over_max_connections_are_refused_and_counted() -> None:
    with Listener(max_connections=2) as listener:
        held = [connect(listener.port) for _ in range(2)]
        assert all(held)
        deadline = time.monotonic() + 10  # a peer has the greeting a moment before the count is updated
        while listener.stats().connections < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.stats().connections == 2
        assert connect(listener.port) is None
        assert wait_for(listener, "limit")["limit"] == 1
        for sock in held:
            assert sock is not None
            sock.close()


@pytest.mark.parametrize(
    "message",
    [
        AbortReq(peer="p" * 64, room=2**63 - 1),
        Metadata(peer="p" * 64, room=2**63 - 1, pages=[2**31 - 1 - i for i in range(256)]),
        Metadata(peer="p" * 64, room=2**63 - 1, pages=[70000 + i for i in range(256)]),
        Hello(
            peer="p" * 64,
            incarnation=2**63 - 1,
            session="\U0001f600" * 256,
            base=2**63 - 1,
            page_bytes=1 << 24,
            pages=1 << 24,
        ),
    ],
    ids=lambda m: type(m).__name__,
)
def test_the_inbox_budget_counts_at_least_what_a_message_holds(message: object) -> None:
    body = msgspec.msgpack.encode(message)
    tracemalloc.start()
    try:
        held = [(decode([HEADER, body]), 0) for _ in range(100)]  # with the inbox's slot for each
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held[0][0] == message
    assert size / 100 <= message_cost(held[0][0])
