"""kvfsm.wire: the strict codec, a live listener that outlives a fuzz, bounded per-peer state, and CURVE."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import pytest

from kvfsm.showcase.bench.pd import fuzz
from kvfsm.wire import (
    HEADER,
    MAX_BODY,
    MESSAGE_TYPES,
    AbortAck,
    AbortReq,
    Curve,
    Heartbeat,
    Hello,
    Listener,
    Metadata,
    Request,
    Sender,
    WireError,
    decode,
    encode,
)

EXAMPLES = [
    Request(peer="decode", room=7),
    Metadata(peer="decode", room=7, pages=[3, 4, 5, 6]),
    AbortReq(peer="decode", room=7),
    AbortAck(peer="prefill", room=7),
    Hello(peer="decode", incarnation=1, session="127.0.0.1:1234", base=0, page_bytes=512, pages=64),
    Heartbeat(peer="prefill", incarnation=2, seq=9),
]


def body(**fields: object) -> list[bytes]:
    return [HEADER, msgspec.msgpack.encode(fields)]


def reason(frames: list[bytes]) -> str:
    with pytest.raises(WireError) as info:
        decode(frames)
    return info.value.reason


def wait_for(listener: Listener, received: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while listener.stats().received < received and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_the_codec(message: object) -> None:
    assert decode(encode(message)) == message  # type: ignore[arg-type]


def test_every_message_type_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} | {__import__("kvfsm.wire", fromlist=["x"]).Succeeded,
                                          __import__("kvfsm.wire", fromlist=["x"]).Failed} == set(MESSAGE_TYPES)  # fmt: skip


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        ([HEADER], "frames"),
        ([HEADER, b"", b""], "frames"),
        ([b"hello", b"\x80"], "header"),
        ([b"kvfsm/2", encode(EXAMPLES[0])[1]], "version"),
        ([HEADER, b"\x81" + b"\x00" * (MAX_BODY + 1)], "oversized"),
        ([HEADER, b"\xc1"], "malformed"),
        (body(type="shutdown", peer="decode"), "unknown_type"),
        (body(type="abort_req", peer="decode", room=-1), "invalid"),
        (body(type="abort_req", peer="decode", room="7"), "invalid"),
        (body(type="abort_req", peer="decode", room=7, extra=1), "invalid"),
        (body(type="abort_req", room=7), "invalid"),
        (body(type="metadata", peer="decode", room=7, pages=list(range(257))), "invalid"),
        (body(type="metadata", peer="d e", room=7, pages=[1]), "invalid"),
        (
            [HEADER, msgspec.msgpack.encode({"type": "abort_req", "peer": b"\xff".decode("latin-1"), "room": 1})],
            "invalid",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_bad_message_is_refused_with_the_reason_it_is_counted_under(frames: list[bytes], expected: str) -> None:
    assert reason(frames) == expected


def test_a_str_field_that_is_not_utf8_is_malformed_not_a_crash() -> None:
    raw = bytearray(encode(AbortReq(peer="decode", room=1))[1])
    raw[raw.index(b"decode") + 1] = 0xEF  # what the fuzz first found: msgspec raises UnicodeDecodeError here
    assert reason([HEADER, bytes(raw)]) == "malformed"


def test_the_listener_binds_loopback_by_default() -> None:
    with Listener() as listener:
        assert listener.endpoint.startswith("tcp://127.0.0.1:")


def test_the_listener_survives_a_fuzz_of_5000_malformed_messages_and_still_takes_a_valid_one() -> None:
    result = fuzz(5000, seed=1)
    assert result.listener_deaths == 0
    assert result.received == 5001 and result.accepted_valid == 1
    assert sum(result.drops.values()) + result.accepted == result.received and "internal" not in result.drops
    assert {"frames", "version", "oversized", "malformed", "unknown_type", "invalid", "unknown_id"} <= set(result.drops)


@pytest.mark.slow
def test_the_listener_survives_a_fuzz_of_100000_malformed_messages_in_bounded_memory() -> None:
    result = fuzz(100_000, seed=2)
    assert result.listener_deaths == 0 and result.accepted_valid == 1
    assert sum(result.drops.values()) + result.accepted == result.received and "internal" not in result.drops
    assert result.rss_growth_mib < 64


def test_a_flood_of_unknown_peers_keeps_at_most_max_peers_of_them() -> None:
    with Listener(max_peers=8) as listener:
        sender = Sender(listener.endpoint)
        for i in range(200):
            sender.send(AbortReq(peer=f"peer-{i}", room=i))
        wait_for(listener, 200)
        stats = listener.stats()
        sender.close()
    assert stats.peers == 8 and stats.peers_evicted == 192


def test_a_full_inbox_drops_as_backlog_instead_of_growing() -> None:
    with Listener(inbox=10) as listener:
        sender = Sender(listener.endpoint)
        for i in range(100):
            sender.send(AbortReq(peer="decode", room=i))
        wait_for(listener, 100)
        taken = listener.take(limit=1000)
        sender.close()
        assert len(taken) == 10 and listener.stats().drops == {"backlog": 90}


def test_a_check_that_refuses_an_id_drops_the_message_under_its_reason() -> None:
    with Listener(check=lambda m: "unknown_id" if getattr(m, "room", 0) > 5 else None) as listener:
        sender = Sender(listener.endpoint)
        sender.send(AbortReq(peer="decode", room=9))
        sender.send(AbortReq(peer="decode", room=1))
        wait_for(listener, 2)
        assert listener.take(timeout=1.0) == [AbortReq(peer="decode", room=1)]
        assert listener.stats().drops == {"unknown_id": 1}
        sender.close()


def test_with_curve_a_keyless_peer_is_refused_and_a_keyed_one_may_speak_only_for_itself() -> None:
    curve, keys = Curve.generate(["decode", "other"])
    try:
        with Listener(curve=curve) as listener:
            keyless = Sender(listener.endpoint)
            decode_peer = Sender(listener.endpoint, key=keys["decode"])
            other = Sender(listener.endpoint, key=keys["other"])
            keyless.send(AbortReq(peer="decode", room=1))  # never gets past the handshake
            other.send(AbortReq(peer="decode", room=2))  # a real key, naming another peer
            decode_peer.send(AbortReq(peer="decode", room=3))
            wait_for(listener, 2)
            time.sleep(0.3)
            taken = listener.take(limit=10)
            stats = listener.stats()
            for s in (keyless, decode_peer, other):
                s.close()
    finally:
        curve.close()
    assert taken == [AbortReq(peer="decode", room=3)]
    assert stats.received == 2 and stats.drops == {"unauthenticated": 1}


def test_without_pyzmq_the_sockets_say_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['zmq'] = None\n"
        "import kvfsm.wire as w\n"
        "assert w.decode(w.encode(w.AbortReq(peer='d', room=1))).room == 1\n"
        "try:\n    w.Listener\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'kvfsm[zmq]'" in out.stdout, out.stderr
