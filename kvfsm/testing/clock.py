"""The manual clock: time that moves only when a test or a benchmark says so, so deadlines are reproducible."""

from __future__ import annotations

__all__ = ["VirtualClock"]


class VirtualClock:
    """A clock to pass as ``Tracker(clock=...)``: calling it reads ``now``; set or :meth:`advance` it to move time.

    It never moves by itself, so every deadline fires exactly when the caller
    moves the clock past it and then polls.
    """

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` and return the new ``now``; time never runs backwards."""
        if not seconds >= 0.0:  # also refuses NaN
            raise ValueError(f"VirtualClock.advance({seconds!r}): time only moves forward; pass a number >= 0")
        self.now += seconds
        return self.now
