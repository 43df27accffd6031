"""What the real-agent NIXL tests ask of a prefill process and its decode ranks (importable without NIXL)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol


class _Peer(Protocol):
    def stats(self) -> dict[str, Any]: ...


class _Decode(Protocol):
    def leaked(self) -> Any: ...


class PeerOutcomes:
    """Outcomes read from the prefill process once they are there, never what is held at an instant."""

    peer: _Peer
    decode: list[Any]
    wait = 3.0
    """Seconds ``stats_once`` waits by default (a notification takes milliseconds to arrive)."""

    def stats_once(self, ready: Callable[[dict[str, Any]], bool], until: float | None = None) -> dict[str, Any]:
        """The peer's stats once ``ready`` holds for them, or after ``until`` seconds (the assertion then says why)."""
        deadline = time.monotonic() + (self.wait if until is None else until)
        stats = self.peer.stats()
        while not ready(stats) and time.monotonic() < deadline:
            time.sleep(0.02)
            stats = self.peer.stats()
        return stats

    def leaked(self) -> int:
        return sum(len(d.leaked()) for d in self.decode) + int(self.peer.stats()["leaked"])
