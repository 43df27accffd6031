"""The peer-process harness (``kvfsm.harness.peer``) with a tiny peer (``tests/peers/tiny_peer.py``).

A peer that answers is talked to in JSON lines; one that dies, one that
hangs, one that is stopped and one that never starts each end in a
``PeerError`` that says which of these happened, names the module and quotes
its log, within the deadline given.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from kvfsm.harness.peer import PeerError, PeerProcess

PEERS = Path(__file__).parent / "peers"


def tiny(behaviour: str, **kwargs: float | None) -> PeerProcess:
    return PeerProcess("tiny_peer", [behaviour], env={"PYTHONPATH": str(PEERS)}, **kwargs)


def test_a_peer_says_hello_answers_each_command_and_exits_when_stdin_closes() -> None:
    with tiny("answers") as peer:
        assert peer.hello == {"hello": "answers"}
        assert peer.call("ping", n=1)["echo"] == {"op": "ping", "n": 1, "seq": 1}
        assert peer.call("ping", n=2)["echo"]["n"] == 2
    assert peer.proc.returncode == 0


def test_a_refused_command_is_a_peer_error_with_the_peer_s_reason_and_the_peer_goes_on() -> None:
    with tiny("answers") as peer:
        with pytest.raises(PeerError, match=r"`tiny_peer` \(pid \d+\) refused 'boom': ValueError: boom is not a"):
            peer.call("boom")
        assert peer.call("ping")["echo"]["op"] == "ping"


def test_a_peer_that_dies_is_named_with_its_exit_code_and_the_end_of_its_log() -> None:
    with tiny("dies") as peer, pytest.raises(PeerError) as caught:
        peer.call("ping", timeout=2.0)
    said = str(caught.value)
    assert "`tiny_peer`" in said and "exited with code 3 before answering 'ping'" in said, said
    assert said.endswith("its log ends:\ntiny peer: dies\ntiny peer: dying with 3"), said


def test_a_silent_peer_is_told_apart_from_a_dead_one_within_the_deadline() -> None:
    with tiny("hangs") as peer:
        start = time.monotonic()
        with pytest.raises(PeerError, match=r"is running but did not answer 'ping' within 0.3 s; its log ends"):
            peer.call("ping", timeout=0.3)
        assert time.monotonic() - start < 1.5
        peer.stop(wait=0.2)
    assert peer.proc.returncode == -signal.SIGKILL


def test_a_stopped_peer_is_said_to_be_stopped_and_its_late_answer_is_not_taken_for_the_next() -> None:
    with tiny("answers") as peer:
        peer.signal(signal.SIGSTOP)
        with pytest.raises(PeerError, match=r"is stopped \(SIGSTOP\) but did not answer 'first' within 0.2 s"):
            peer.call("first", timeout=0.2)
        peer.signal(signal.SIGCONT)
        assert peer.call("second", timeout=2.0)["echo"]["op"] == "second"


def test_a_killed_peer_is_named_with_its_signal() -> None:
    with tiny("answers") as peer:
        peer.kill()
        with pytest.raises(PeerError, match=r"was killed by SIGKILL before answering 'ping'"):
            peer.call("ping")


def test_a_peer_that_never_says_hello_fails_to_start_within_the_start_timeout_and_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(PeerError) as caught:
        tiny("never_says_hello", start_timeout=0.5)
    assert "`tiny_peer`" in str(caught.value), caught.value
    assert "is running but did not answer its hello within 0.5 s" in str(caught.value), caught.value
    assert time.monotonic() - start < 2.5


def test_a_peer_that_cannot_start_says_why_and_peers_started_side_by_side_are_waited_for_in_turn() -> None:
    peers = [tiny(behaviour, start_timeout=None) for behaviour in ("answers", "cannot_start")]
    try:
        assert peers[0].wait_hello(5.0) == {"hello": "answers"}
        with pytest.raises(PeerError, match=r"`tiny_peer` \(pid \d+\) did not start: no model at /nowhere; its log"):
            peers[1].wait_hello(5.0)
    finally:
        for peer in peers:
            peer.stop()
