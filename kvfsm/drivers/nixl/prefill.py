"""The prefill side: one TP rank's hold on each finished request's blocks, freed by the decode side's notifications.

:class:`BlockHolder` is the driver of ``specs/nixl_prefill.yaml``;
:class:`PrefillRank` owns a rank's blocks, agent and tracker, and turns the
notifications it receives into events once per step. A notification is parsed
with a guard (malformed ones are counted, never raised) and handed to the
tracker as it is, routed by the prefill's own request id: the driver filters
no id itself. One for a request this rank has not begun yet (the decode side
was quicker than the step that hands over request_finished's blocks) is kept
by the tracker (the spec declares ``read`` early) and applied at
:meth:`~PrefillRank.hold`, which then frees the blocks at once; one whose id
never begins within ``early_within`` (seed 004's decode-local id) is dropped as
an ``early`` anomaly in the ``request_id`` space; a late one for a finished
request is ignored by the spec.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from functools import cache
from typing import Any, Generic

from ...engine import Tracker
from ...engine.tracker import Observer
from ...errors import ActionError, Anomaly
from ...observe import drain_outcomes
from ...spec import Spec, load
from ...spec.bundled import SPECS
from ..dataplane import DataPlane
from ..report import Finished, Report, SendReport
from .blocks import KVBlocks, M, own_blocks
from .memory import BlockMemory
from .notif import parse
from .topology import Topology


@cache
def prefill_spec() -> Spec:
    """The bundled ``nixl_prefill`` spec, loaded once."""
    return load(SPECS / "nixl_prefill.yaml")


class BlockHolder(SendReport):
    """Actions of ``nixl_prefill``: owe finished_sending, hold a request's blocks for its readers, free and report.

    Who has read them is the spec's to count (``count: readers``), not this driver's.
    """

    def __init__(self, blocks: BlockMemory, report: Report | None = None) -> None:
        self.blocks = blocks
        self.pool = blocks.pool
        self.report = report if report is not None else Report()
        self._owed: set[Hashable] = set()
        """The ``send_report`` record: requests vLLM keeps blocks for until finished_sending names them."""

    @staticmethod
    def holder(key: Hashable) -> tuple[str, Hashable]:
        return ("nixl_send", key)

    def hold_blocks(self, key: Hashable, /, block_ids: Sequence[int]) -> None:
        self.pool.pin(self.holder(key), block_ids)

    def free_blocks(self, key: Hashable, /) -> None:
        self.pool.release(self.holder(key))

    def observe(self, key: Hashable) -> set[str]:
        held = {"kv_blocks"} if self.pool.held_by(self.holder(key)) else set()
        if key in self._owed:
            held.add("send_report")
        return held


class PrefillRank(Generic[M]):
    """One prefill TP rank: blocks registered with its agent, a tracker of held requests, notifications in."""

    def __init__(
        self,
        rank: int,
        topology: Topology,
        agent: DataPlane,
        num_blocks: int,
        *,
        params: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: Observer | None = None,
        on_anomaly: Callable[[Anomaly], None] | None = None,
        blocks: M | None = None,
    ) -> None:
        """``observer`` and ``on_anomaly`` go to the tracker: a journal is both. ``blocks`` is the memory the
        decode side READs (vLLM's cache, :class:`~.memory.CacheBlocks`); without it the rank owns
        ``num_blocks`` :class:`KVBlocks`."""
        self.rank = rank
        self.topology = topology
        self.agent = agent
        self.blocks: M = own_blocks(blocks, num_blocks, topology.block_bytes(topology.prefill_tp))
        for tensor in self.blocks.tensors():
            agent.register(tensor)
        self.driver = BlockHolder(self.blocks)
        self.tracker = Tracker(
            prefill_spec(), self.driver, params=params, clock=clock, observer=observer, on_anomaly=on_anomaly
        )
        self.counts: Counter[str] = Counter()
        """``malformed`` notifications dropped and ``notifs`` delivered; :meth:`stats` adds the tracker's
        ``partial`` (counted, the count not complete) and ``duplicate`` (a reader heard twice)."""
        self.outcomes: Counter[str] = Counter()
        """Finished requests by final state: ``read``, ``expired``, ``aborted``."""
        self.anomalies: Counter[str] = Counter()
        """The tracker's dropped events by ``kind:space``: ``early:request_id`` for a notification whose id this
        rank did not begin within ``early_within`` (seed 004's decode-local id), ``late:request_id`` for one that
        came after the request ended and was drained."""
        self.anomaly_ids: deque[Hashable] = deque(maxlen=64)
        """The latest ids the anomalies named, for a message that shows them."""
        self.errors: list[ActionError] = []
        """Holds the pool refused: each is already reported finished_sending, kept here for the story."""

    def compute(self, request_id: str, n_blocks: int) -> list[int]:
        """The prefill forward pass: allocate ``n_blocks`` for the request and write its KV into them.

        Only kvfsm's own blocks: in vLLM's cache the model writes the KV.
        """
        memory = self.blocks
        if not isinstance(memory, KVBlocks):
            raise TypeError(
                f"compute() writes a test pattern into KVBlocks; this rank's blocks are {type(memory).__name__}"
            )
        blocks = memory.pool.allocate(request_id, n_blocks)
        lo, _ = self.topology.range(self.rank, self.topology.prefill_tp)
        memory.fill(blocks, request_id, lo)
        return blocks

    def request_finished(self, request_id: str, block_ids: Sequence[int]) -> None:
        """vLLM's request_finished with delay_free: the connector holds the blocks, the scheduler lets go of its own."""
        self.hold(request_id, block_ids)
        self.blocks.pool.release(request_id)

    def hold(self, request_id: str, block_ids: Sequence[int]) -> None:
        """The connector becomes a holder of ``block_ids`` for the decode side's READ (the owner keeps its own hold).

        Notifications for ``request_id`` that came before it (kept by the tracker) are applied here: if every
        reader has said it is done, the blocks are freed before this returns. A hold the pool refuses (unusable
        block ids) is reported finished_sending all the same (undoing ``send_report``), never raised into vLLM.
        """
        try:
            self.tracker.begin(request_id, block_ids=list(block_ids))
        except ActionError as exc:
            self.errors.append(exc)

    def abort(self, request_id: str) -> None:
        self.tracker.fire(request_id, "abort")

    def on_notifs(self, notifs: Sequence[tuple[str, bytes]]) -> None:
        """Deliver a step's notifications, ``(sending agent, bytes)``, as ``read`` batches, one per sender and count.

        ``deliver_many`` routes them by the space the spec declares for
        ``read`` (this rank's own request id), each with the agent that sent
        it: an id not begun yet is kept with its sender and count until
        :meth:`hold` begins it, or dropped as ``early`` after
        ``early_within``. The spec counts the distinct readers of each request
        and frees the blocks on the last (``readers``: decode world size /
        prefill TP, from the notification), and a second notification from one
        reader is a ``duplicate``, never a read.
        """
        batches: dict[tuple[str, int], list[str]] = {}
        for sender, raw in notifs:
            notif = parse(raw)
            if notif is None:
                self.counts["malformed"] += 1
                continue
            self.counts["notifs"] += 1
            batches.setdefault((sender, self.topology.expected(notif.world_size)), []).append(notif.request_id)
        for (sender, readers), ids in batches.items():
            self.tracker.deliver_many("read", ids, sender=sender, readers=readers)

    def stats(self) -> Counter[str]:
        """:attr:`counts` with the tracker's count of ``read``: ``partial`` arrivals, ``duplicate`` readers, and
        ``kept_early`` notifications that came before their request was begun (applied at :meth:`hold`, or
        dropped as ``early`` anomalies)."""
        counts = self.tracker.counts
        return self.counts + Counter(
            {"partial": counts["counted"], "duplicate": counts["duplicate"], "kept_early": counts["kept_early"]}
        )

    def step(self, now: float | None = None) -> Finished:
        """Once per scheduler step: take the notifications, fire due expiries, drain finished_sending."""
        self.on_notifs(self.agent.notifs())
        self.tracker.poll(now)
        self.anomaly_ids.extend(a.id for a in drain_outcomes(self.tracker, self.outcomes, self.anomalies))
        return self.driver.report.take()

    def held_requests(self) -> int:
        """Requests whose blocks the connector still holds."""
        return self.tracker.live()

    def leaked(self) -> dict[Hashable, tuple[int, ...]]:
        """Holders of blocks once every request ended: empty unless something leaked."""
        return self.blocks.pool.holdings()


def engine_stats(ranks: Sequence[PrefillRank[Any]]) -> dict[str, Any]:
    """A prefill engine's ranks summed: held requests per rank, leaked holders, outcomes, counts, anomalies."""
    outcomes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    anomalies: Counter[str] = Counter()
    for r in ranks:
        outcomes.update(r.outcomes)
        counts.update(r.stats())
        anomalies.update(r.anomalies)
    return {
        "held": [r.held_requests() for r in ranks],
        "leaked": sum(len(r.leaked()) for r in ranks),
        "outcomes": dict(outcomes),
        "counts": dict(counts),
        "anomalies": dict(anomalies),
        "anomaly_ids": [str(i) for r in ranks for i in r.anomaly_ids],
    }
