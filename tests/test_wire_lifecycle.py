"""What a listener starts, its close() releases: a restart on its port with new CURVE keys works, and so do two listeners with keys of their own.

Each listener with CURVE runs a ZAP authenticator, which binds
``inproc://zeromq.zap.01`` once per ZMQ context; one left running (or shared
through ``zmq.Context.instance()``) made the next listener fail with
``Address already in use``. The threads it leaves behind are counted from
``/proc/self/task``, so libzmq's own I/O threads count too.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import zmq

from kvfsm.wire import AbortReq, ClientKey, Curve, Listener, Sender


def tasks() -> int:
    """Every thread of this process, Python's and libzmq's."""
    return len(os.listdir("/proc/self/task")) if Path("/proc/self/task").exists() else threading.active_count()


@pytest.fixture
def baseline() -> int:
    """This process's threads once the shared context Senders use has started its own."""
    zmq.Context.instance().socket(zmq.PUSH).close(linger=0)
    return tasks()


def settle(expected: int, timeout: float = 10.0) -> int:
    """The thread count once it is back to ``expected`` (threads end a moment after they are told to)."""
    deadline = time.monotonic() + timeout
    while tasks() != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return tasks()


def deliver(listener: Listener, room: int, key: ClientKey | None = None, peer: str = "decode") -> bool:
    """Whether a Sender (with ``key``) gets one message to ``listener`` within 10 s."""
    sender = Sender(listener.endpoint, key=key)
    try:
        sender.send(AbortReq(peer=peer, room=room))
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if AbortReq(peer=peer, room=room) in listener.take(timeout=0.1):
                return True
        return False
    finally:
        sender.close()


def refused(listener: Listener, key: ClientKey, peer: str, reason: str, timeout: float = 10.0) -> bool:
    """Whether a Sender with a ``key`` that ``listener`` does not take is dropped under ``reason``, its message never taken.

    A key made for another listener fails the CURVE handshake itself
    (``handshake``); a key pair never issued, made out to the right listener,
    is refused by the authenticator (``auth``).
    """
    before = listener.stats().connection_drops.get(reason, 0)
    sender = Sender(listener.endpoint, key=key)
    try:
        sender.send(AbortReq(peer=peer, room=99))
        deadline = time.monotonic() + timeout
        while listener.stats().connection_drops.get(reason, 0) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        return listener.stats().connection_drops.get(reason, 0) > before and listener.take(timeout=0.2) == []
    finally:
        sender.close()


def stranger(curve: Curve) -> ClientKey:
    """A client key pair nobody issued, made out to ``curve``'s listener."""
    public, secret = zmq.curve_keypair()
    return ClientKey("stranger", public, secret, curve.public)


def test_a_listener_restarted_on_its_port_with_new_keys_takes_the_new_keys_only(baseline: int) -> None:
    old, old_keys = Curve.generate(["decode"])
    first = Listener(curve=old)
    port = first.port
    assert deliver(first, 1, old_keys["decode"])
    first.close()  # and not old.close(): the listener releases what it started
    assert settle(baseline) == baseline
    new, new_keys = Curve.generate(["decode"])
    with Listener(port=port, curve=new) as second:
        assert deliver(second, 2, new_keys["decode"])
        assert refused(second, old_keys["decode"], "decode", "handshake")
        assert refused(second, stranger(new), "decode", "auth")
    assert settle(baseline) == baseline


def test_two_listeners_in_one_process_each_take_their_own_keys(baseline: int) -> None:
    a_curve, a_keys = Curve.generate(["decode"])
    b_curve, b_keys = Curve.generate(["prefill"])
    with Listener(curve=a_curve) as a, Listener(curve=b_curve) as b:
        assert deliver(a, 1, a_keys["decode"])
        assert deliver(b, 2, b_keys["prefill"], peer="prefill")
        assert refused(a, b_keys["prefill"], "prefill", "handshake")
        assert refused(b, a_keys["decode"], "decode", "handshake")
        assert refused(b, stranger(b_curve), "prefill", "auth")
    assert settle(baseline) == baseline


def test_a_listener_without_curve_restarts_on_its_port_and_leaves_no_thread(baseline: int) -> None:
    first = Listener()
    port = first.port
    assert deliver(first, 1)
    first.close()
    first.close()  # idempotent
    assert settle(baseline) == baseline
    with Listener(port=port) as second:
        assert deliver(second, 2)
    assert settle(baseline) == baseline


def test_a_port_in_use_is_a_clear_error_and_leaves_nothing_running(baseline: int) -> None:
    curve, _ = Curve.generate(["decode"])
    with Listener() as taken:
        for kwargs in ({}, {"curve": curve}):
            with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{taken.port}"):
                Listener(port=taken.port, **kwargs)  # type: ignore[arg-type]
    assert settle(baseline) == baseline
