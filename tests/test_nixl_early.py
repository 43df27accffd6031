"""A decode notification that reaches a NIXL prefill rank before the rank holds the request (``read`` is early).

vLLM's prefill worker takes notifications (``get_new_notifs``) apart from the
step whose ``start_load_kv`` hands it ``request_finished``'s blocks, so a quick
decode can notify a rank that has not begun the request. ``nixl_prefill``
declares ``read`` early: the tracker keeps such a notification, with its
sender and count, and applies it when the rank begins the request (the blocks
are freed at once, never expired); one whose id never begins is dropped as an
``early`` anomaly after ``early_within``; past ``keep`` (4096) kept at once the
excess is dropped as ``early`` at once.

The embedded tests run on a fake clock; the ``nixl`` ones run the prefill ranks
with real NIXL agents in a subprocess (:class:`PeerProcess`) and assert
outcomes the peer reports once it has them, never what is held at an instant.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from nixl_peer import PeerOutcomes

pytest.importorskip("torch")

from kvfsm.drivers.nixl import DecodeRank, Fabric, PeerInfo, PrefillRank, Topology, encode, prefill_spec
from kvfsm.drivers.nixl.decode import BlockReader
from kvfsm.harness.nixl import faulty
from kvfsm.showcase.nixl_seed import LocalIdReader

KEEP = 4096
"""``nixl_prefill``'s ``early: keep``."""
EARLY_WITHIN = 2.0
ABORT_TIMEOUT = 30.0


def test_the_spec_keeps_at_most_4096_notifications_for_early_within_seconds() -> None:
    decl = prefill_spec().event_decls["read"]
    assert decl.early is not None and (decl.early.keep, decl.early.within) == (KEEP, "early_within")
    assert prefill_spec().params["early_within"] < prefill_spec().params["abort_timeout"] / 10


# -- embedded fabric, fake clock ---------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """Prefill ranks and decode ranks on one fabric and a fake clock; the prefill computes before it holds."""

    def __init__(
        self, topology: Topology, reader: type[BlockReader] = BlockReader, blocks: int = 32,
        faults: dict[int, list[str]] | None = None,
    ) -> None:  # fmt: skip
        self.fabric, self.clock, self.topology = Fabric(), Clock(), topology
        params = {"abort_timeout": ABORT_TIMEOUT, "early_within": EARLY_WITHIN}
        self.prefill = [
            PrefillRank(r, topology, self.fabric.agent(f"p{r}"), blocks, params=params, clock=self.clock)
            for r in range(topology.prefill_tp)
        ]
        self.decode = []
        for d in range(topology.decode_tp):
            agent: Any = self.fabric.agent(f"d{d}")
            if (faults or {}).get(d):
                agent = faulty(agent, 1.0, faults=(faults or {})[d])
            self.decode.append(DecodeRank(d, topology, agent, 32, params={"read_timeout": 5.0}, clock=self.clock,
                                          reader=reader))  # fmt: skip
        peers = [PeerInfo("E", p.rank, p.agent.name, p.agent.metadata(), p.blocks.base, p.blocks.block_bytes)
                 for p in self.prefill]  # fmt: skip
        for d in self.decode:
            d.handshake(peers)
        self.computed: dict[str, list[list[int]]] = {}

    def compute(self, rid: str, n: int = 2) -> None:
        """The forward pass on every rank; the blocks are not held yet (request_finished has not reached them)."""
        self.computed[rid] = [p.compute(rid, n) for p in self.prefill]

    def read(self, rid: str, n: int = 2) -> None:
        """Every decode rank READs ``rid``'s blocks and notifies, as its plan says."""
        for d in self.decode:
            key = f"d{d.rank}-{rid}"
            d.start_load(
                key, rid, "E", d.blocks.pool.allocate(key, n), self.computed[rid][self.topology.group(d.rank)[0]]
            )
            for done in d.step().recving:
                d.blocks.pool.release(done)

    def hold(self, rid: str) -> set[str]:
        """request_finished on every rank; what the ranks report in finished_sending at once."""
        sending: set[str] = set()
        for p, blocks in zip(self.prefill, self.computed[rid], strict=True):
            p.request_finished(rid, blocks)
            sending |= {str(k) for k in p.step().sending}
        return sending

    def step(self, now: float | None = None) -> None:
        if now is not None:
            self.clock.now = now
        for p in self.prefill:
            p.step()

    def leaked(self) -> int:
        return sum(len(p.leaked()) for p in self.prefill) + sum(len(d.leaked()) for d in self.decode)


def test_a_notification_before_the_hold_is_applied_at_the_hold_and_frees_the_blocks_at_once() -> None:
    c = Cluster(Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=256))
    c.compute("p-1")
    c.read("p-1")  # decode READs rank 0 and send_notifs rank 1, before either rank holds the request
    c.step()
    assert c.decode[0].outcomes == {"loaded": 1}
    for p in c.prefill:
        assert p.tracker.counts["kept_early"] == 1 and p.stats()["kept_early"] == 1
        assert p.held_requests() == 0 and not p.outcomes and not p.anomalies
    assert c.hold("p-1") == {"p-1"}, "every rank reports the request in finished_sending in the step it holds it"
    assert [dict(p.outcomes) for p in c.prefill] == [{"read": 1}] * 2
    assert [p.held_requests() for p in c.prefill] == [0, 0] and c.leaked() == 0
    c.step(ABORT_TIMEOUT + EARLY_WITHIN + 1)  # nothing is left to expire, nothing kept to drop
    assert [dict(p.outcomes) for p in c.prefill] == [{"read": 1}] * 2
    assert all(not p.anomalies and p.tracker.counts["early"] == 0 for p in c.prefill)


def test_early_notifications_keep_their_senders_so_a_duplicate_never_stands_in_for_a_reader() -> None:
    """Decode TP 2 × prefill TP: rank 0's notification comes twice before the hold, rank 1's never."""
    c = Cluster(
        Topology(prefill_tp=1, decode_tp=2, mla=False, kv_bytes=256), faults={0: ["duplicate_notif"], 1: ["lost_notif"]}
    )
    c.compute("p-1")
    c.read("p-1")
    c.step()
    p = c.prefill[0]
    assert p.tracker.counts["kept_early"] == 2 and p.held_requests() == 0
    c.hold("p-1")
    assert p.held_requests() == 1, "decode rank 1 may still be reading"
    assert p.stats()["duplicate"] == 1 and p.stats()["partial"] == 1
    c.step(ABORT_TIMEOUT)
    assert p.outcomes == {"expired": 1} and c.leaked() == 0


def test_readers_split_around_the_hold_are_counted_together() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=2, mla=False, kv_bytes=256), faults={1: ["lost_notif"]})
    c.compute("p-1")
    c.read("p-1")
    c.step()
    p = c.prefill[0]
    c.hold("p-1")
    assert p.held_requests() == 1 and p.stats()["partial"] == 1, "rank 0's early notification counted at the hold"
    c.fabric.agents["d1"].send_notif("p0", encode("p-1", 2))  # rank 1's, after the hold (past its lossy wrapper)
    c.step()
    assert p.outcomes == {"read": 1} and p.tracker.counts["kept_early"] == 1 and c.leaked() == 0


def test_an_id_that_never_begins_is_dropped_as_early_after_the_window_and_the_expiry_frees_the_rest() -> None:
    c = Cluster(Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=256), reader=LocalIdReader)
    c.compute("p-1")
    c.read("p-1")  # seed 004: rank 1 is told the decode-local id, d0-p-1
    c.hold("p-1")
    skipped = c.prefill[1]
    assert c.prefill[0].outcomes == {"read": 1} and skipped.held_requests() == 1
    assert skipped.tracker.counts["kept_early"] == 1 and not skipped.anomalies, "it may yet begin: kept"
    c.step(EARLY_WITHIN)
    assert skipped.anomalies == {"early:request_id": 1} and list(skipped.anomaly_ids) == ["d0-p-1"]
    assert skipped.tracker.counts["early"] == 1 and skipped.held_requests() == 1
    c.step(ABORT_TIMEOUT)
    assert skipped.outcomes == {"expired": 1} and c.leaked() == 0


def test_a_notification_after_the_request_ended_is_late_not_kept() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256))
    c.compute("p-1")
    c.hold("p-1")
    c.read("p-1")
    c.step()
    assert c.prefill[0].outcomes == {"read": 1}
    c.decode[0].agent.send_notif("p0", encode("p-1", 1))  # resent after the request was drained
    c.step()
    assert c.prefill[0].anomalies == {"late:request_id": 1} and c.prefill[0].tracker.counts["kept_early"] == 0


def test_past_keep_notifications_at_once_the_excess_is_dropped_as_early_and_waits_for_the_expiry() -> None:
    n = KEEP + 2
    c = Cluster(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=64), blocks=n)
    ids = [f"p-{i}" for i in range(n)]
    for rid in ids:
        c.compute(rid, 1)
    for rid in ids:  # every reader's notification, before any hold
        c.decode[0].agent.send_notif("p0", encode(rid, 1))
    c.step()
    p = c.prefill[0]
    assert p.tracker.counts["kept_early"] == KEEP and p.anomalies == {"early:request_id": 2}
    assert list(p.anomaly_ids) == ids[-2:], "the bound drops the ones that came past it"
    for rid in ids:
        c.hold(rid)
    assert p.outcomes == {"read": KEEP} and p.held_requests() == 2
    c.step(ABORT_TIMEOUT)
    assert p.outcomes == {"read": KEEP, "expired": 2} and p.anomalies == {"early:request_id": 2} and c.leaked() == 0


# -- real NIXL agents: prefill ranks in a subprocess ---------------------------------------------------------------------

_names = itertools.count()


class Real(PeerOutcomes):
    """A prefill process that computes now and holds later, and decode ranks here, all with real NIXL agents."""

    wait = 10.0

    def __init__(
        self, topology: Topology, *, abort_timeout: float, early_within: float, blocks: int = 64,
        reader: type[BlockReader] = BlockReader,
    ) -> None:  # fmt: skip
        from kvfsm.drivers.nixl.agent import NixlAgent
        from kvfsm.harness.nixl.peer import PeerProcess

        self.topology = topology
        self.peer = PeerProcess(topology, blocks, abort_timeout=abort_timeout, early_within=early_within)
        self.decode: list[DecodeRank[Any]] = []
        for d in range(topology.decode_tp):
            agent = NixlAgent(f"decode-early-{os.getpid()}-{next(_names)}")
            self.peer.add_decode(agent.metadata())
            rank = DecodeRank(d, topology, agent, 64, params={"read_timeout": 10.0}, reader=reader)
            rank.handshake(self.peer.peers)
            self.decode.append(rank)

    def read(self, rid: str, remote: list[list[int]]) -> None:
        """Every decode rank READs and notifies; stepped until each load ended."""
        for d in self.decode:
            key = f"d{d.rank}-{rid}"
            n = len(remote[0])
            d.start_load(
                key, rid, self.peer.engine_id, d.blocks.pool.allocate(key, n), remote[self.topology.group(d.rank)[0]]
            )
        deadline = time.monotonic() + 10.0
        while any(d.tracker.live() for d in self.decode) and time.monotonic() < deadline:
            for d in self.decode:
                for key in d.step().recving:
                    d.blocks.pool.release(key)
            time.sleep(0.002)


@pytest.fixture
def real() -> Iterator[list[Real]]:
    pytest.importorskip("nixl", reason="needs the nixl wheels: pip install 'kvfsm[nixl]'")
    made: list[Real] = []
    yield made
    for r in made:
        r.peer.stop()


@pytest.mark.nixl
@pytest.mark.parametrize(
    "topology",
    [
        Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=4096),
        Topology(prefill_tp=1, decode_tp=2, mla=False, kv_bytes=4096),
    ],
    ids=["mla_broadcast", "two_readers"],
)
def test_nixl_real_early_notifications_are_applied_at_the_hold_and_free_the_blocks_at_once(
    real: list[Real], topology: Topology
) -> None:
    # A window no loaded machine outlasts before the hold: only the keeping can free these blocks before the expiry.
    r = Real(topology, abort_timeout=60.0, early_within=60.0)
    real.append(r)
    remote = r.peer.compute({"p-1": 3})["p-1"]
    r.read("p-1", remote)
    assert [d.outcomes for d in r.decode] == [{"loaded": 1}] * topology.decode_tp
    kept = max(topology.prefill_tp, topology.decode_tp)  # one notification per (decode rank, prefill rank) read
    stats = r.stats_once(lambda s: s["counts"].get("kept_early", 0) >= kept)
    assert stats["counts"].get("kept_early") == kept and not stats["outcomes"] and not stats["anomalies"]
    assert stats["held"] == [0] * topology.prefill_tp, "nothing held before the hold"
    r.peer.hold(["p-1"])
    stats = r.stats_once(lambda s: sum(s["outcomes"].values()) == topology.prefill_tp)
    assert stats["outcomes"] == {"read": topology.prefill_tp}, "freed by the kept notifications, not the expiry"
    assert stats["held"] == [0] * topology.prefill_tp and not stats["anomalies"]
    assert r.leaked() == 0


@pytest.mark.nixl
def test_nixl_real_early_an_id_that_never_begins_is_dropped_as_early_after_the_window(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=4096), abort_timeout=1.5, early_within=0.5,
             reader=LocalIdReader)  # fmt: skip
    real.append(r)
    remote = r.peer.serve({"p-1": 3})["p-1"]
    r.read("p-1", remote)
    stats = r.stats_once(lambda s: sum(s["outcomes"].values()) == 2 and bool(s["anomalies"]))
    assert stats["anomalies"] == {"early:request_id": 1} and stats["anomaly_ids"] == ["d0-p-1"]
    assert stats["counts"]["kept_early"] == 1
    # The rank that was read freed on its notification; the skipped one, its id never begun, only at expiry.
    assert stats["outcomes"] == {"read": 1, "expired": 1} and stats["held"] == [0, 0]
    assert r.leaked() == 0


@pytest.mark.nixl
def test_nixl_real_early_past_keep_the_excess_is_dropped_as_early(real: list[Real]) -> None:
    n = KEEP + 2
    r = Real(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=64), abort_timeout=1.0, early_within=60.0,
             blocks=n)  # fmt: skip
    real.append(r)
    ids = [f"p-{i}" for i in range(n)]
    r.peer.compute(dict.fromkeys(ids, 1))
    agent, peer = r.decode[0].agent, r.peer.peers[0].agent
    for rid in ids:
        agent.send_notif(peer, encode(rid, 1))
    stats = r.stats_once(lambda s: s["counts"].get("kept_early", 0) + s["anomalies"].get("early:request_id", 0) == n)
    assert stats["counts"].get("kept_early") == KEEP and stats["anomalies"] == {"early:request_id": 2}
    r.peer.hold(ids)
    stats = r.stats_once(lambda s: sum(s["outcomes"].values()) == n)
    assert stats["outcomes"] == {"read": KEEP, "expired": 2}, "the two dropped waited for the expiry"
    assert stats["anomalies"] == {"early:request_id": 2} and stats["held"] == [0]
    assert r.leaked() == 0
