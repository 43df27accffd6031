"""What a prefill and a decode engine share: registered blocks, a tracker driven once per step, and what it costs.

Every call into the tracker goes through :class:`Side`, which adds its time
to :attr:`Side.seconds` (kvfsm's own cost per request, apart from the
transport's) and keeps an :class:`~kvfsm.errors.ActionError` instead of
raising it: the tracker has already put the instance in its ``on_error``
state, so the step goes on with the other requests.

A rank's blocks are kvfsm's own :class:`~kvfsm.drivers.nixl.blocks.KVBlocks`
(one tensor, a byte pattern per request that the decode side checks) unless
it is given a :class:`~kvfsm.drivers.nixl.memory.BlockMemory`: vLLM's own KV
cache (:class:`~kvfsm.drivers.nixl.memory.CacheBlocks`), where the writes land
in the blocks the model attends over.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Any

from ...engine import Tracker
from ...errors import ActionError
from ...observe import drain_outcomes
from ...spec import Spec
from ..nixl.blocks import own_blocks
from ..nixl.memory import BlockMemory
from .plane import PlaneTransport


def counted_events(spec: Spec) -> frozenset[str]:
    """The events ``spec`` counts (``count:`` on a transition): each arrival must say which rank sent it."""
    return frozenset(event for _, event in spec.counted())


def count_senders(
    spec: Spec, event: str, senders: int | None, params: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """``params`` with ``senders`` as the count of ``event``: the param the spec counts it by (``count: <param>``).

    ``senders`` None leaves the count to ``params`` or the spec's default. A spec that does not count ``event``
    waits for one message (any number other than 1 is refused), and one that counts it by anything but a param
    is refused too: the engine has nowhere to put the number.
    """
    given = dict(params) if params is not None else None
    if senders is None:
        return given
    counted = [t for (_, e), t in spec.counted().items() if e == event]
    if not counted:
        if senders != 1:
            raise ValueError(f"machine {spec.name!r} does not count {event!r}: it cannot wait for {senders} ranks")
        return given
    source = spec.count_source(counted[0])
    if source is None or source[0] != "param":
        raise ValueError(
            f"machine {spec.name!r} counts {event!r} by {counted[0].count!r}, not by a param: "
            f"it cannot be told to wait for {senders} ranks"
        )
    name = str(source[1])
    out = given if given is not None else {}
    if name in out and out[name] != senders:
        raise ValueError(f"{senders} ranks (acks) and params {name}={out[name]!r} disagree on the count of {event!r}")
    out[name] = senders
    return out


class Side:
    """A tracker and its counters: outcomes by final state, anomalies by ``kind:space``, errors kept."""

    tracker: Tracker
    counted: frozenset[str] = frozenset()
    """The events the spec counts by sender (:func:`counted_events`): :meth:`_heard` says which rank sent each."""

    def __init__(
        self, transport: PlaneTransport, num_blocks: int, block_bytes: int, mode: str, blocks: BlockMemory | None = None
    ) -> None:
        """The rank's blocks (``blocks``, or kvfsm's own), registered with ``transport``; ``mode`` is ``write`` or
        ``read``."""
        if mode not in ("write", "read"):
            raise ValueError(f"mode must be 'write' or 'read', not {mode!r}")
        self.mode = mode
        self.transport = transport
        self.blocks: BlockMemory = own_blocks(blocks, num_blocks, block_bytes)
        for tensor in self.blocks.tensors():
            transport.register(tensor)
        self.counts: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.anomalies: Counter[str] = Counter()
        self.errors: list[ActionError] = []
        self.seconds = 0.0
        """Time spent inside the tracker (begin, fire, deliver, poll): what kvfsm costs this side."""
        self.owner: Hashable | None = None
        """The pool holder of blocks the rank only borrows (vLLM's allocator, see :meth:`borrow_from`); None: it owns them."""

    def borrow_from(self, owner: Hashable) -> None:
        """Every block belongs to ``owner`` (vLLM's allocator): the drivers' holds are pins on top of its hold."""
        self.blocks.pool.allocate(owner, self.blocks.pool.num_blocks)
        self.owner = owner

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

    def _heard(self, event: str, transfer_id: str, rank: int, **payload: Any) -> None:
        """A peer rank's ``event`` for ``transfer_id``: where the spec counts it, ``rank`` is the sender counted, so
        a message repeated by one rank is a ``duplicate``, never another rank's."""
        if event in self.counted:
            self._deliver(event, transfer_id, sender=rank, **payload)
        else:
            self._deliver(event, transfer_id, **payload)

    def _poll(self, now: float | None) -> None:
        """Fire due deadlines, then count what finished and what was dropped."""
        t = time.perf_counter()
        self.tracker.poll(now)
        drain_outcomes(self.tracker, self.outcomes, self.anomalies)
        self.seconds += time.perf_counter() - t

    def held_blocks(self) -> int:
        """Blocks the connector's holds keep, not counting ``owner``'s (vLLM's allocator, when it lends its cache)."""
        return sum(len(b) for h, b in self.blocks.pool.holdings().items() if h != self.owner)

    def side_stats(self) -> dict[str, object]:
        return {
            "live": self.tracker.live(),
            "held_blocks": self.held_blocks(),
            "counts": dict(self.counts),
            "outcomes": dict(self.outcomes),
            "anomalies": dict(self.anomalies),
            "errors": len(self.errors),
            "tracker_seconds": self.seconds,
        }
