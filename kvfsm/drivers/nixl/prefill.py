"""The prefill side: one TP rank's hold on each finished request's blocks, freed by the decode side's notifications.

:class:`BlockHolder` is the driver of ``specs/nixl_prefill.yaml``;
:class:`PrefillRank` owns a rank's blocks, agent and tracker, and turns the
notifications it receives into events once per step. A notification is parsed
with a guard (malformed ones are counted, never raised) and routed by the
prefill's own request id; an id this rank does not hold is the Tracker's
``unknown`` anomaly in the ``request_id`` space (seed 004's symptom), a late
one for a finished request is ignored by the spec.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from functools import cache
from typing import Any, Generic

from ...engine import Tracker
from ...engine.tracker import Observer
from ...errors import Anomaly
from ...spec import Spec, load
from ...spec.bundled import SPECS
from ..report import Finished, Report
from .blocks import KVBlocks, M, own_blocks
from .memory import BlockMemory
from .notif import parse
from .topology import Topology
from .transport import Transport


@cache
def prefill_spec() -> Spec:
    """The bundled ``nixl_prefill`` spec, loaded once."""
    return load(SPECS / "nixl_prefill.yaml")


class BlockHolder:
    """Actions of ``nixl_prefill``: hold a request's blocks for its readers, free them and report finished_sending.

    ``_reads[key]`` counts the notifications a held request has had; it is part
    of the ``kv_blocks`` hold, taken by :meth:`hold_blocks` and dropped by
    :meth:`free_blocks`, so it lives exactly as long as the blocks are held.
    """

    def __init__(self, blocks: BlockMemory, report: Report | None = None) -> None:
        self.blocks = blocks
        self.pool = blocks.pool
        self.report = report if report is not None else Report()
        self._reads: dict[Hashable, int] = {}

    @staticmethod
    def holder(key: Hashable) -> tuple[str, Hashable]:
        return ("nixl_send", key)

    def hold_blocks(self, key: Hashable, /, block_ids: Sequence[int]) -> None:
        self.pool.pin(self.holder(key), block_ids)
        self._reads[key] = 0

    def free_blocks(self, key: Hashable, /) -> None:
        del self._reads[key]
        self.pool.release(self.holder(key))
        self.report.send(key)

    def count_read(self, key: Hashable, expected: int) -> bool:
        """One more reader is done with ``key``'s blocks: True once ``expected`` have said so (or it is not held)."""
        if key not in self._reads:
            return True
        self._reads[key] += 1
        return self._reads[key] >= expected

    def observe(self, key: Hashable) -> set[str]:
        return {"kv_blocks"} if self.pool.held_by(self.holder(key)) else set()


class PrefillRank(Generic[M]):
    """One prefill TP rank: blocks registered with its agent, a tracker of held requests, notifications in."""

    def __init__(
        self,
        rank: int,
        topology: Topology,
        agent: Transport,
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
        """``malformed`` notifications dropped, ``partial`` ones counted toward a ratio, ``read`` events fired."""
        self.outcomes: Counter[str] = Counter()
        """Finished requests by final state: ``read``, ``expired``, ``aborted``."""
        self.anomalies: Counter[str] = Counter()
        """The tracker's dropped events by ``kind:space`` (``unknown:request_id`` for an id this rank never held)."""
        self.unknown_ids: deque[Hashable] = deque(maxlen=64)
        """The latest ids the anomalies named, for a message that shows them."""

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
        """The connector becomes a holder of ``block_ids`` for the decode side's READ (the owner keeps its own hold)."""
        self.tracker.begin(request_id, block_ids=list(block_ids))

    def abort(self, request_id: str) -> None:
        self.tracker.fire(request_id, "abort")

    def on_notif(self, raw: bytes) -> None:
        """Apply one notification; a malformed one is counted and dropped."""
        self.on_notifs([raw])

    def on_notifs(self, raws: Sequence[bytes]) -> None:
        """Apply a step's notifications as one batch: ``read`` for each request whose last expected one came.

        The batch goes to ``deliver_many``, routed by the space the spec
        declares for ``read`` (this rank's own request id): an id this rank
        does not hold is counted as unknown, a repeated one as late or ignored.
        """
        ready = []
        for raw in raws:
            notif = parse(raw)
            if notif is None:
                self.counts["malformed"] += 1
            elif self.driver.count_read(notif.request_id, self.topology.expected(notif.world_size)):
                self.counts["read"] += 1
                ready.append(notif.request_id)
            else:
                self.counts["partial"] += 1
        if ready:
            self.tracker.deliver_many("read", ready)

    def step(self, now: float | None = None) -> Finished:
        """Once per scheduler step: take the notifications, fire due expiries, drain finished_sending."""
        self.on_notifs(self.agent.notifs())
        self.tracker.poll(now)
        for _, final in self.tracker.finished():
            self.outcomes[final] += 1
        for anomaly in self.tracker.anomalies():
            self.anomalies[f"{anomaly.kind}:{anomaly.space}"] += 1
            self.unknown_ids.append(anomaly.id)
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
        counts.update(r.counts)
        anomalies.update(r.anomalies)
    return {
        "held": [r.held_requests() for r in ranks],
        "leaked": sum(len(r.leaked()) for r in ranks),
        "outcomes": dict(outcomes),
        "counts": dict(counts),
        "anomalies": dict(anomalies),
        "anomaly_ids": [str(i) for r in ranks for i in r.unknown_ids],
    }
