"""What a prefill and a decode engine share: registered blocks, a tracker driven once per step, and what it costs.

Every call into the tracker goes through :class:`Side`, which adds its time
to :attr:`Side.seconds` (kvfsm's own cost per request, apart from the
transport's) and keeps an :class:`~kvfsm.errors.ActionError` instead of
raising it: the tracker has already put the instance in its ``on_error``
state, so the step goes on with the other requests.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable
from typing import Any

from ...engine import Tracker
from ...errors import ActionError
from ..nixl.blocks import KVBlocks
from .transport import Transport


class Side:
    """A tracker and its counters: outcomes by final state, anomalies by ``kind:space``, errors kept."""

    tracker: Tracker

    def __init__(self, transport: Transport, num_blocks: int, block_bytes: int, mode: str) -> None:
        """The rank's blocks, registered with ``transport``; ``mode`` is ``write`` or ``read``."""
        if mode not in ("write", "read"):
            raise ValueError(f"mode must be 'write' or 'read', not {mode!r}")
        self.mode = mode
        self.transport = transport
        self.blocks = KVBlocks(num_blocks, block_bytes)
        transport.register(self.blocks.tensor)
        self.counts: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.anomalies: Counter[str] = Counter()
        self.errors: list[ActionError] = []
        self.seconds = 0.0
        """Time spent inside the tracker (begin, fire, deliver, poll): what kvfsm costs this side."""

    def _call(self, method: Any, *args: Any, **payload: Any) -> None:
        t = time.perf_counter()
        try:
            method(*args, **payload)
        except ActionError as exc:  # the instance is already in its on_error state
            self.errors.append(exc)
        finally:
            self.seconds += time.perf_counter() - t

    def _fire(self, key: Hashable, event: str) -> None:
        self._call(self.tracker.fire, key, event)

    def _fire_many(self, event: str, keys: list[Hashable]) -> None:
        if keys:
            self._call(self.tracker.fire_many, event, keys)

    def _deliver(self, event: str, transfer_id: str, **payload: Any) -> None:
        self._call(self.tracker.deliver, event, transfer_id, **payload)

    def _poll(self, now: float | None) -> None:
        """Fire due deadlines, then count what finished and what was dropped."""
        t = time.perf_counter()
        self.tracker.poll(now)
        for _, final in self.tracker.finished():
            self.outcomes[final] += 1
        for anomaly in self.tracker.anomalies():
            self.anomalies[f"{anomaly.kind}:{anomaly.space}"] += 1
        self.seconds += time.perf_counter() - t

    def side_stats(self) -> dict[str, object]:
        return {
            "live": self.tracker.live(),
            "held_blocks": sum(len(b) for b in self.blocks.pool.holdings().values()),
            "counts": dict(self.counts),
            "outcomes": dict(self.outcomes),
            "anomalies": dict(self.anomalies),
            "errors": len(self.errors),
            "tracker_seconds": self.seconds,
        }
