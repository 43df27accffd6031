"""The P/D job's faults, on the one :class:`~kvfsm.harness.faults.FaultPlan`: control messages lost, duplicated,
delayed, reordered or malformed on their way out, actions that raise, writes that are slow.

Each role draws from plans seeded per role and incarnation, one per kind of
opportunity: a message sent (a fault at the job's rate, keyed by its type,
its room and how many such messages went before it), an action run (at half
the rate, by action and room, through
:class:`~kvfsm.harness.faults.FaultyActions`), a chunk written (slow, at the
rate, by room and chunk). :class:`FaultyLink` applies the message faults: a malformed message
is a mangled copy, which the peer's listener counts and drops. How long a
delay holds a message and how a copy is mangled come from the role's seeded
generator. The requests decode aborts and the kill of the prefill process are
the job's scenario, not faults; the ledger counts them beside the faults.
"""

from __future__ import annotations

import random
from collections import Counter

from ...wire import Message, encode, tag
from ...wire.sender import Sender
from ..faults import FaultPlan

MESSAGE_FAULTS = ("lost_message", "duplicate_message", "delayed_message", "reordered_message", "malformed_message")
FAULTS = (*MESSAGE_FAULTS, "raising_send_kv", "raising_send_metadata", "slow_write")
"""Every fault a role's plans may name: a message's, an action's (prefill's ``send_kv``, decode's
``send_metadata``), a chunk's write."""
SCENARIO = ("abort", "kill")
"""Requests decode aborts, and the prefill process killed and restarted (the coordinator's)."""
KINDS = (*FAULTS, *SCENARIO)
"""Every kind a ledger counts."""


def plan(rate: float, kinds: tuple[str, ...], seed: int) -> FaultPlan:
    """A plan for one kind of a role's opportunities: a fraction ``rate`` of them meet one of ``kinds``."""
    return FaultPlan(rate, kinds, seed, known=FAULTS)


class FaultyLink:
    """Sends protocol messages to one peer under ``plan``'s message faults; :meth:`flush` sends what a delay or a
    reorder held back. ``injected`` counts the faults by kind."""

    def __init__(
        self, sender: Sender, plan: FaultPlan, rng: random.Random, delay: tuple[float, float] = (0.005, 0.050)
    ) -> None:
        self.sender = sender
        self.plan = plan
        self.rng = rng
        self.injected: Counter[str] = Counter()
        self._delay = delay
        self._sent: Counter[tuple[str, object]] = Counter()
        self._later: list[tuple[float, list[bytes]]] = []
        self._held: list[bytes] | None = None

    def send(self, message: Message, now: float) -> None:
        frames = encode(message)
        which = (tag(message), getattr(message, "room", None))
        fault = self.plan.fault(f"{which[0]}/{which[1]}/{self._sent[which]}")
        self._sent[which] += 1
        if fault in MESSAGE_FAULTS:
            self.injected[fault] += 1
            if fault == "lost_message":
                return
            if fault == "malformed_message":
                self.sender.send_frames(self._mangle(frames))
                return
            if fault == "delayed_message":
                self._later.append((now + self.rng.uniform(*self._delay), frames))
                return
            if fault == "reordered_message" and self._held is None:
                self._held = frames
                return
            if fault == "duplicate_message":
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
        if self._held is not None and self.rng.random() < 0.1:
            self.sender.send_frames(self._held)
            self._held = None

    def _mangle(self, frames: list[bytes]) -> list[bytes]:
        header, body = frames
        how = self.rng.randrange(5)
        if how == 0:
            return [header, body[: self.rng.randrange(len(body))]]
        if how == 1:
            return [header]
        if how == 2:
            return [header, body, b"extra"]
        if how == 3:
            return [b"kvfsm/9", body]
        return [header, bytes(b ^ 0x5A for b in body)]
