"""The NIXL drivers on real NIXL agents in two processes: prefill ranks in a subprocess, decode ranks here.

Each test starts its own prefill process (:class:`PeerProcess`) and stops it by
pid, also on failure. Named ``test_nixl_real_*`` so ``-k nixl_real`` selects them.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import itertools
import signal
import time
from collections.abc import Callable, Iterator

import pytest
from nixl_peer import PeerOutcomes

pytest.importorskip("nixl", reason="needs the nixl wheels: pip install 'kvfsm[nixl]'")

from kvfsm.drivers.nixl import DecodeRank, Topology
from kvfsm.drivers.nixl.agent import NixlAgent
from kvfsm.drivers.nixl.decode import BlockReader
from kvfsm.harness.nixl import faulty
from kvfsm.harness.nixl.peer import PeerProcess
from kvfsm.showcase.bench.nixl import soak
from kvfsm.showcase.nixl_seed import LocalIdReader

_names = itertools.count()


class Real(PeerOutcomes):
    """A prefill process and the decode ranks of a topology in this process, all with real NIXL agents."""

    def __init__(
        self, topology: Topology, *, abort_timeout: float = 30.0, read_timeout: float = 5.0,
        reader: type[BlockReader] = BlockReader, lost: bool = False, faults: dict[int, list[str]] | None = None,
        early_within: float = 0.5,
    ) -> None:  # fmt: skip
        """``lost``: every decode rank's notifications are lost; ``faults``: decode rank → the faults its agent
        injects on every request (see :func:`kvfsm.harness.nixl.faulty`)."""
        self.topology = topology
        self.peer = PeerProcess(topology, 64, abort_timeout=abort_timeout, early_within=early_within)
        self.decode = []
        for d in range(topology.decode_tp):
            agent = NixlAgent(f"decode-{os.getpid()}-{next(_names)}")
            injected = ["lost_notif"] if lost else (faults or {}).get(d)
            transport = faulty(agent, 1.0, faults=injected) if injected else agent
            rank = DecodeRank(d, topology, transport, 64, params={"read_timeout": read_timeout}, reader=reader)
            self.peer.add_decode(agent.metadata())
            rank.handshake(self.peer.peers)
            self.decode.append(rank)

    def request(self, rid: str, n: int = 3) -> None:
        remote = self.peer.serve({rid: n})[rid]
        for d in self.decode:
            key = f"d{d.rank}-{rid}"
            d.start_load(
                key, rid, self.peer.engine_id, d.blocks.pool.allocate(key, n), remote[self.topology.group(d.rank)[0]]
            )

    def settle(self, until: float = 5.0) -> None:
        """Step the decode ranks until nothing is live or ``until`` seconds passed."""
        self.step_while(lambda: any(d.tracker.live() for d in self.decode), until)

    def step_while(self, busy: Callable[[], bool], until: float) -> None:
        """Step the decode ranks (the scheduler freeing what each reports) while ``busy()``, at most ``until`` s."""
        deadline = time.monotonic() + until
        while True:
            for d in self.decode:
                for key in d.step().recving:
                    d.blocks.pool.release(key)
            if time.monotonic() > deadline or not busy():
                return
            time.sleep(0.002)

    def held(self, until: float = 3.0, want: int = 0) -> list[int]:
        """The prefill ranks' held requests, once they reach ``want`` in total or ``until`` seconds passed."""
        deadline = time.monotonic() + until
        stats = self.peer.stats()
        while sum(stats["held"]) != want and time.monotonic() < deadline:
            time.sleep(0.02)
            stats = self.peer.stats()
        held: list[int] = stats["held"]
        return held


@pytest.fixture
def real(request: pytest.FixtureRequest) -> Iterator[list[Real]]:
    made: list[Real] = []
    yield made
    for r in made:
        r.peer.stop()


def test_nixl_real_mla_broadcast_frees_every_prefill_rank_at_once(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=4096))
    real.append(r)
    r.request("p-1")
    r.settle()
    assert r.decode[0].outcomes == {"loaded": 1} and r.decode[0].driver.stats["blocks_verified"] == 3
    assert r.decode[0].driver.outbox.counts == {"sent": 2}  # the READ's notification and one send_notif, both right
    assert r.held() == [0, 0]
    assert r.stats_once(lambda s: sum(s["outcomes"].values()) == 2)["outcomes"] == {"read": 2}
    assert r.leaked() == 0


def test_nixl_real_seed_004_local_id_holds_the_skipped_rank_until_expiry(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=4096), abort_timeout=1.5, early_within=0.5,
             reader=LocalIdReader)  # fmt: skip
    real.append(r)
    r.request("p-1")
    r.settle()
    assert r.decode[0].outcomes == {"loaded": 1}
    [sent] = r.decode[0].driver.outbox.misaddressed()  # caught where it left, over real agents
    assert (sent.sent, sent.carries, sent.expected) == ("d0-p-1", "remote_request_id", "p-1")
    # Kept as a notification that may have come before its request, then dropped when the id never began.
    stats = r.stats_once(lambda s: bool(s["anomalies"]))
    assert stats["anomalies"] == {"early:request_id": 1} and stats["anomaly_ids"] == ["d0-p-1"]
    assert stats["counts"]["kept_early"] == 1
    assert r.held(until=5.0) == [0, 0]
    # The rank that was read freed on its notification; the skipped one, unable to match the id, only at expiry.
    assert r.stats_once(lambda s: sum(s["outcomes"].values()) == 2)["outcomes"] == {"read": 1, "expired": 1}
    assert r.leaked() == 0


def test_nixl_real_decode_tp_above_prefill_tp_counts_notifications_to_the_ratio(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=1, decode_tp=2, mla=False, kv_bytes=4096))
    real.append(r)
    r.request("p-1")
    r.settle()
    assert [d.outcomes for d in r.decode] == [{"loaded": 1}] * 2
    assert r.held() == [0]
    stats = r.stats_once(lambda s: bool(s["outcomes"]))
    assert stats["counts"] == {"notifs": 2, "partial": 1} and stats["outcomes"] == {"read": 1}
    assert r.leaked() == 0


def test_nixl_real_a_duplicated_notification_never_stands_in_for_a_reader_still_reading(real: list[Real]) -> None:
    """Decode TP = 2 × prefill TP: rank 0's notification comes twice, rank 1's never. Counting raw notifications
    frees the blocks on the duplicate while rank 1 may still READ them; the spec counts readers and holds them."""
    faults = {0: ["duplicate_notif"], 1: ["lost_notif"]}
    r = Real(Topology(prefill_tp=1, decode_tp=2, mla=False, kv_bytes=4096), abort_timeout=1.0, faults=faults)
    real.append(r)
    r.request("p-1")
    r.settle()
    assert [d.outcomes for d in r.decode] == [{"loaded": 1}] * 2
    stats = r.stats_once(lambda s: bool(s["outcomes"]), until=5.0)
    assert stats["counts"]["duplicate"] == 1 and stats["counts"]["notifs"] == 2
    assert stats["outcomes"] == {"expired": 1}, "freed by the expiry, never by rank 0's second notification"
    assert r.held() == [0] and r.leaked() == 0


def test_nixl_real_lost_notification_is_freed_by_the_expiry(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=4096), abort_timeout=1.0, lost=True)
    real.append(r)
    r.request("p-1")
    r.settle()
    assert r.decode[0].outcomes == {"loaded": 1}
    assert r.held(until=5.0) == [0]
    # Freed by the expiry, not by a notification: the one sent was lost.
    assert r.stats_once(lambda s: bool(s["outcomes"]))["outcomes"] == {"expired": 1}
    assert r.leaked() == 0


def test_nixl_real_abort_mid_read_releases_the_handles(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=2, decode_tp=1, mla=False, kv_bytes=4096), abort_timeout=1.0)
    real.append(r)
    r.request("p-1", n=16)
    r.decode[0].abort("d0-p-1")
    r.settle()
    assert r.decode[0].outcomes == {"aborted": 1} and r.decode[0].reading() == []
    assert r.held(until=5.0) == [0, 0]
    assert r.leaked() == 0


def test_nixl_real_dead_peer_fails_the_load_at_once(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=4096))
    real.append(r)
    r.request("p-1")
    r.settle()  # the connection is up
    r.peer.signal(signal.SIGKILL)
    r.peer.proc.wait(timeout=10)
    d = r.decode[0]
    d.start_load("d0-p-2", "p-2", r.peer.engine_id, d.blocks.pool.allocate("d0-p-2", 3), [0, 1, 2])
    r.settle()
    assert d.outcomes == {"loaded": 1, "failed": 1}
    assert d.errors, "the failed load must say why"
    failure = d.errors[-1]
    why = f"{type(failure).__name__}: {failure} / {type(failure.__cause__).__name__}: {failure.__cause__}"
    assert "Disconnect" in why or "DISCONNECT" in why, why
    assert sum(len(x) for x in [d.leaked()]) == 0


def test_nixl_real_hung_peer_read_is_expired_by_the_decode_deadline_once_it_stops(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=4096), read_timeout=3.0, abort_timeout=1.0)
    real.append(r)
    r.request("p-1")
    r.settle()
    remote = r.peer.serve({"p-2": 64 - 3})["p-2"][0]
    r.peer.signal(signal.SIGSTOP)
    d = r.decode[0]
    d.start_load("d0-p-2", "p-2", r.peer.engine_id, d.blocks.pool.allocate("d0-p-2", 61), remote)
    time.sleep(0.2)
    d.step()
    assert d.tracker.state("d0-p-2") == "reading", "NIXL keeps a READ on a stopped peer in PROC"
    r.step_while(lambda: d.tracker.state("d0-p-2") == "reading", until=8.0)
    assert d.tracker.state("d0-p-2") == "expiring" and d.reading() == ["d0-p-2"], "given up, the READ still in flight"
    r.peer.signal(signal.SIGCONT)
    r.settle(until=8.0)
    assert d.outcomes == {"loaded": 1, "expired": 1} and d.reading() == []
    assert r.held(until=5.0) == [0]
    assert r.leaked() == 0


def test_nixl_real_a_read_given_up_on_lands_only_while_the_request_still_holds_its_blocks(
    real: list[Real], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/nixl.md §6: over UCX tcp (a data path that needs the peer to run, as a network without RDMA) a READ
    from a stopped peer lands whenever the peer runs again, whatever the decode side released meanwhile. The
    request gives up at its deadline but keeps its blocks pinned and unreported (vLLM cannot give them to
    another request) until the READ has landed; after that nothing more is written there."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by each agent at creation; the peer process inherits it
    r = Real(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=4096), read_timeout=0.5)
    real.append(r)
    remote = r.peer.serve({"p-1": 3})["p-1"][0]
    r.peer.signal(signal.SIGSTOP)
    d = r.decode[0]
    blocks = d.blocks.pool.allocate("d0-p-1", 3)
    d.start_load("d0-p-1", "p-1", r.peer.engine_id, blocks, remote)
    r.step_while(lambda: d.tracker.state("d0-p-1") == "reading", until=10.0)
    assert d.tracker.state("d0-p-1") == "expiring" and d.reading() == ["d0-p-1"]
    assert d.driver.owes("d0-p-1") and d.blocks.pool.held_by(d.driver.holder("d0-p-1"))
    assert d.blocks.wrong(blocks, "p-1", 0) == blocks, "the READ landed before the peer ran again"
    r.peer.signal(signal.SIGCONT)
    r.settle(until=10.0)  # the READ lands, the request ends and is reported, the scheduler frees its blocks
    assert d.outcomes == {"expired": 1} and d.read_outcomes == {"done": 1}
    assert d.blocks.wrong(blocks, "p-1", 0) == [], "the late READ landed while the request still held its blocks"
    d.blocks.tensor[list(blocks)] = 0xEE  # the blocks' next owner
    time.sleep(0.3)
    assert bool((d.blocks.tensor[list(blocks)] == 0xEE).all()), "a byte of the READ landed after the blocks were freed"
    assert r.held(until=5.0) == [0] and r.leaked() == 0


def test_nixl_real_malformed_notifications_are_counted_and_dropped(real: list[Real]) -> None:
    r = Real(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=4096))
    real.append(r)
    agent = r.decode[0].agent
    peer = r.peer.peers[0].agent
    for raw in (b"no-colon", b"p-1:", b"p-1:four", b"\xff\xfe:1", b"nobody:1"):
        agent.send_notif(peer, raw)
    r.request("p-1")
    r.settle()
    assert r.held() == [0]
    # 'nobody' is kept for early_within (it may yet begin), then dropped as early.
    stats = r.stats_once(lambda s: s["counts"].get("malformed", 0) >= 4 and bool(s["anomalies"]))
    assert stats["counts"]["malformed"] == 4 and stats["anomalies"] == {"early:request_id": 1}
    assert r.leaked() == 0


def test_nixl_real_soak_with_ten_percent_faults_leaks_and_hangs_nothing() -> None:
    result = soak(requests=600, concurrency=128, fault_rate=0.1, real=True, abort_timeout=1.0, read_timeout=5.0)
    assert result.ok, result
    assert set(result.faults) == {"raising_read", "lost_notif", "duplicate_notif", "malformed_notif"}


@pytest.mark.slow
def test_nixl_real_soak_at_concurrency_512() -> None:
    result = soak(requests=4096, concurrency=512, fault_rate=0.1, real=True)
    assert result.ok, result
