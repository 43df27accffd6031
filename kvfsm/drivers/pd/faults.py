"""Fault injection for a P/D job: one random source per process, every fault counted by kind.

At each opportunity (a message sent, an action run, a chunk written, a
request begun) a fault happens with the job's fault rate. Message faults are
applied by :class:`FaultyLink` on the way out: dropped, duplicated, delayed,
reordered (held back until after the next message) or malformed (a mangled
copy goes out instead, which the peer's listener counts and drops).
"""

from __future__ import annotations

import random
from collections import Counter

from ...wire import Message, encode
from ...wire.sender import Sender

MESSAGE_FAULTS = ("drop", "duplicate", "delay", "reorder", "malformed")
KINDS = ("raise", "abort", "slow_write", "kill", *MESSAGE_FAULTS)
"""Every kind a ledger counts; ``kill`` (the prefill process killed and restarted) is the coordinator's."""


class Faults:
    """Decides, with probability ``rate``, whether a fault happens at an opportunity, and counts those that did."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()

    def hit(self, kind: str, scale: float = 1.0) -> bool:
        if self.rate and self.rng.random() < self.rate * scale:
            self.counts[kind] += 1
            return True
        return False

    def uniform(self, bounds: tuple[float, float]) -> float:
        return self.rng.uniform(*bounds)


class FaultyLink:
    """Sends protocol messages to one peer through ``faults``; :meth:`flush` sends what a delay held back."""

    def __init__(self, sender: Sender, faults: Faults, delay: tuple[float, float] = (0.005, 0.050)) -> None:
        self.sender = sender
        self.faults = faults
        self._delay = delay
        self._later: list[tuple[float, list[bytes]]] = []
        self._held: list[bytes] | None = None

    def send(self, message: Message, now: float) -> None:
        frames = encode(message)
        f = self.faults
        if f.rate and f.rng.random() < f.rate:
            kind = f.rng.choice(MESSAGE_FAULTS)
            f.counts[kind] += 1
            if kind == "drop":
                return
            if kind == "malformed":
                self.sender.send_frames(self._mangle(frames))
                return
            if kind == "delay":
                self._later.append((now + f.uniform(self._delay), frames))
                return
            if kind == "reorder" and self._held is None:
                self._held = frames
                return
            if kind == "duplicate":
                self.sender.send_frames(frames)
        self.sender.send_frames(frames)
        if self._held is not None:
            self.sender.send_frames(self._held)
            self._held = None

    def send_reliably(self, message: Message) -> None:
        """The router's and bootstrap's messages (HTTP in SGLang): never faulted."""
        self.sender.send(message)

    def flush(self, now: float) -> None:
        if self._later:
            due = [m for m in self._later if m[0] <= now]
            if due:
                self._later = [m for m in self._later if m[0] > now]
                for _, frames in due:
                    self.sender.send_frames(frames)
        if self._held is not None and self.faults.rng.random() < 0.1:
            self.sender.send_frames(self._held)
            self._held = None

    def _mangle(self, frames: list[bytes]) -> list[bytes]:
        rng = self.faults.rng
        header, body = frames
        how = rng.randrange(5)
        if how == 0:
            return [header, body[: rng.randrange(len(body))]]
        if how == 1:
            return [header]
        if how == 2:
            return [header, body, b"extra"]
        if how == 3:
            return [b"kvfsm/9", body]
        return [header, bytes(b ^ 0x5A for b in body)]
