"""The MoRIIO drivers (seed 001) on the embedded transport: specs, model-based tests, ids, TP counting, faults, the hang.

The specs are checked and explored; the drivers are model-tested against
them (and the pre-fix copies must fail); the engines are run as a 1P1D pair
under a closed-loop load with injected faults, and seed 001's pre-fix
prefill is run at concurrency 512 with lost ``remote_blocks`` to show it hang.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch

import kvfsm
import kvfsm.testing
from kvfsm.drivers.kv_cache import KVCache, KVLayout
from kvfsm.drivers.moriio import (
    DecodeEngine,
    Fabric,
    PlaneTransport,
    PrefillEngine,
    Release,
    RemoteBlocks,
    Source,
    WriteDone,
    decode,
    encode,
    expected_acks,
    moriio_spec,
)
from kvfsm.drivers.moriio.producer import BlockWriter
from kvfsm.drivers.nixl.blocks import KVBlocks
from kvfsm.drivers.nixl.memory import CacheBlocks
from kvfsm.explore import explore
from kvfsm.harness.faults import FaultPlan
from kvfsm.harness.moriio.cluster import embedded_run, faulty
from kvfsm.showcase.moriio_modeltest import FACTORIES
from kvfsm.showcase.moriio_seed import PRE_FIX_PREFILL, PreFixModelReader, PreFixModelWriter, pre_fix_spec
from kvfsm.spec.system.loader import read_system_file
from kvfsm.testing import VirtualClock

SPECS = Path(kvfsm.__file__).parent / "specs" / "moriio"


# -- the specs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["write_producer", "write_consumer", "read_producer", "read_consumer"])
def test_the_correct_specs_are_clean(name: str) -> None:
    assert kvfsm.spec.check(SPECS / f"{name}.yaml") == []


@pytest.mark.parametrize("name", ["write_producer_pre_fix", "read_producer_pre_fix", "read_consumer_pre_fix"])
def test_the_pre_fix_specs_are_rejected_for_waiting_without_a_deadline(name: str) -> None:
    codes = {f.code for f in kvfsm.spec.check(SPECS / f"{name}.yaml") if f.severity == "error"}
    assert codes == {"KVF107"}


def test_transfer_id_is_a_declared_space_apart_from_the_request_id() -> None:
    for name in ["write_producer", "write_consumer", "read_producer", "read_consumer"]:
        spec = moriio_spec(name)
        assert spec.key == "request_id"
        assert "transfer_id" in spec.spaces
        assert all(
            spec.routed_by(e) == "transfer_id" for e in ("remote_blocks", "write_done", "release") if e in spec.events
        )


@pytest.mark.parametrize("system", ["write", "read"])
def test_explore_verifies_the_correct_compositions(system: str) -> None:
    result = explore(SPECS / f"{system}.yaml")
    assert result.verdict == "verified", [p.name for p in result.violated]


@pytest.mark.parametrize("system", ["write_pre_fix", "read_pre_fix"])
def test_explore_finds_the_leak_of_the_pre_fix_compositions(system: str) -> None:
    draft = read_system_file(SPECS / f"{system}.yaml")
    assert {f.code for f in draft.findings if f.severity == "error"} == {"KVF107"}
    result = explore(draft.system, first=True)
    assert result.verdict == "violated"
    trace = result.violated[0].as_dict()["trace"]
    assert trace["property"] in ("deadlock", "leak")
    assert "nothing can move producer" in trace["violation"]


# -- model-based tests ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_drivers_pass_their_generated_model_tests(name: str) -> None:
    report = kvfsm.testing.run(moriio_spec(name), FACTORIES[name], examples=15, seed=3)
    assert report.passed, "\n".join(report.story) or report.error


@pytest.mark.parametrize(
    ("name", "factory", "held"),
    [
        ("write_producer", PreFixModelWriter, "src_blocks still held"),
        ("read_consumer", PreFixModelReader, "peer_release still held"),
    ],
)
def test_the_pre_fix_drivers_fail_their_model_tests(name: str, factory: type, held: str) -> None:
    report = kvfsm.testing.run(moriio_spec(name), factory, examples=15, seed=3)
    assert not report.passed
    assert held in "\n".join(report.story)


# -- ids, counting, messages ------------------------------------------------------------


class Pair:
    """One prefill and one decode engine on one fabric, stepped by hand on a virtual clock."""

    def __init__(self, mode: str = "write", acks: int = 1, decode_acks: int = 1) -> None:
        self.fabric = Fabric()
        self.clock = VirtualClock()
        self.p = PrefillEngine(
            PlaneTransport(self.fabric.agent("prefill")), 16, 256, mode=mode, acks=acks, clock=self.clock,
            params={"defer_timeout": 1.0, "transfer_timeout": 1.0} if mode == "write" else {"defer_timeout": 2.0},
        )  # fmt: skip
        self.d = DecodeEngine(
            PlaneTransport(self.fabric.agent("decode")), 16, 256, "prefill", mode=mode, acks=decode_acks, clock=self.clock,
            params={"recv_timeout": 3.0} if mode == "write" else {"transfer_timeout": 1.0},
        )  # fmt: skip

    def step(self) -> None:
        self.p.step()
        self.d.step()


def test_expected_acks_follow_the_heterogeneous_tp_rule() -> None:
    assert [expected_acks(c, p) for c, p in [(1, 1), (4, 2), (8, 1), (2, 4), (1, 8)]] == [1, 2, 8, 1, 1]
    with pytest.raises(ValueError, match="not a multiple"):
        expected_acks(6, 4)
    with pytest.raises(ValueError, match="positive"):
        expected_acks(0, 1)


def test_a_write_is_deferred_until_remote_blocks_and_the_ids_stay_apart() -> None:
    pair = Pair()
    pair.p.compute("p-1", "t-1", 2)
    assert pair.p.tracker.state("p-1") == "deferred"
    pair.d.start("d-1", "t-1", 2)  # sends remote_blocks naming t-1, never d-1 or p-1
    pair.step()
    pair.step()
    assert pair.d.outcomes == {"loaded": 1} and pair.p.outcomes == {"written": 1}
    assert pair.d.stats()["verified_blocks"] == 2
    assert pair.p.stats()["held_blocks"] == 0 and pair.d.stats()["held_blocks"] == 0


def test_remote_blocks_before_the_forward_pass_is_kept_by_the_spec_and_applied_at_hold() -> None:
    pair = Pair()
    pair.d.start("d-1", "t-1", 2)
    pair.step()
    assert pair.p.counts["remote_blocks"] == 1 and pair.p.tracker.live() == 0
    assert pair.p.tracker.counts["kept_early"] == 1 and pair.p.anomalies == {}  # kept (early:), not unknown
    pair.clock.advance(0.9)  # within its window (defer_timeout, 1 s)
    pair.p.compute("p-1", "t-1", 2)
    assert pair.p.tracker.state("p-1") == "writing"  # applied as the hold began: no wait in `deferred`
    pair.step()
    pair.step()
    assert pair.d.outcomes == {"loaded": 1} and pair.p.outcomes == {"written": 1}
    assert pair.p.tracker.counts["early"] == 0 and pair.p.anomalies == {}


@pytest.mark.parametrize("event", ["remote_blocks", "release"])
def test_a_message_kept_past_its_window_is_dropped_as_early_and_the_request_waits_for_its_deadline(
    event: str,
) -> None:
    pair = Pair()
    if event == "remote_blocks":
        pair.p.on_message(RemoteBlocks("t-1", "decode", pair.d.blocks.base, 256, [0, 1]))
    else:
        pair.p.on_message(Release("t-1"))  # WRITE mode: the decode side gave up
    pair.clock.advance(1.5)  # past defer_timeout (1 s): the forward pass came too late for it
    pair.p.step()
    assert pair.p.tracker.counts["early"] == 1 and pair.p.anomalies == {"early:transfer_id": 1}
    pair.p.compute("p-1", "t-1", 2)
    assert pair.p.tracker.state("p-1") == "deferred"  # as if the message never came
    pair.clock.advance(1.5)
    pair.p.step()
    assert pair.p.outcomes == {"expired": 1} and pair.p.stats()["held_blocks"] == 0
    assert pair.p.driver.stats["batches_posted"] == 0


def test_kept_remote_blocks_whose_writes_cannot_be_posted_fail_the_hold_as_post_writes_raising_would() -> None:
    pair = Pair()
    pair.p.on_message(RemoteBlocks("t-1", "nobody", pair.d.blocks.base, 256, [0, 1]))  # no such peer
    pair.p.compute("p-1", "t-1", 2)
    assert pair.p.tracker.state("p-1") == "failed"
    assert "no such agent" in str(pair.p.errors[0].__cause__)
    pair.p.step()
    assert pair.p.outcomes == {"failed": 1} and pair.p.stats()["held_blocks"] == 0
    assert pair.p.driver.stats["batches_posted"] == 0


def test_read_mode_a_release_before_the_hold_is_kept_with_its_rank_and_counted_when_the_hold_begins() -> None:
    pair = Pair(mode="read", acks=2)
    pair.p.on_message(Release("t-1", rank=0))  # the decode rank heard of the blocks before this worker did
    pair.p.on_message(Release("t-1", rank=0))  # repeated by the same rank: kept too, a duplicate once applied
    assert pair.p.tracker.counts["kept_early"] == 2 and pair.p.tracker.live() == 0
    pair.p.compute("p-1", "t-1", 2)
    assert pair.p.tracker.state("p-1") == "held"  # one of two readers heard
    pair.p.on_message(Release("t-1", rank=1))
    pair.p.step()
    assert pair.p.outcomes == {"released": 1} and pair.p.stats()["held_blocks"] == 0
    assert pair.p.anomalies == {"duplicate:request_id": 1}


def test_a_release_beyond_the_bound_is_dropped_as_early_at_once_and_the_kept_ones_still_abort() -> None:
    pair = Pair()
    early = pair.p.tracker.spec.event_decls["release"].early
    assert early is not None
    for i in range(early.keep + 1):
        pair.p.on_message(Release(f"t-{i}"))
    pair.p.step()
    assert pair.p.tracker.counts["kept_early"] == early.keep
    assert pair.p.anomalies == {"early:transfer_id": 1}  # the one past the bound, at once
    pair.p.compute("p-first", "t-0", 1)
    pair.p.compute("p-last", f"t-{early.keep}", 1)
    assert pair.p.tracker.state("p-last") == "deferred"  # its release was dropped: it waits as if none came
    pair.clock.advance(1.5)
    pair.p.step()
    assert pair.p.outcomes == {"aborted": 1, "expired": 1} and pair.p.stats()["held_blocks"] == 0


def test_write_done_from_every_prefill_rank_is_counted_before_the_load_finishes() -> None:
    pair = Pair(decode_acks=2)
    pair.p.compute("p-1", "t-1", 2)
    pair.d.start("d-1", "t-1", 2)
    pair.step()
    pair.step()
    assert pair.d.tracker.state("d-1") == "waiting"  # one of two ranks said so
    pair.d.on_message(WriteDone("t-1", rank=1))
    assert pair.d.tracker.state("d-1") == "loaded"


def test_read_mode_blocks_wait_for_every_release_and_are_reaped_without_it() -> None:
    pair = Pair(mode="read", acks=2)
    pair.p.compute("p-1", "t-1", 2)
    message = decode(encode(Release("t-1")))
    assert message is not None
    pair.p.on_message(message)  # one of the two decode ranks
    assert pair.p.tracker.state("p-1") == "held"
    pair.p.compute("p-2", "t-2", 2)
    pair.clock.advance(2.5)
    pair.p.step()
    assert pair.p.outcomes == {"expired": 2} and pair.p.stats()["held_blocks"] == 0


@pytest.mark.parametrize("give_up", ["expire", "abort"])
def test_read_mode_a_load_given_up_keeps_its_blocks_until_its_reads_have_stopped(give_up: str) -> None:
    """Giving up does not stop a read (docs/moriio.md §6): an expired or aborted load sends its release at once
    but keeps its blocks pinned and its report owed until the batch's status ends; then the pool is whole."""
    pair = Pair(mode="read")
    assert isinstance(pair.p.blocks, KVBlocks)
    source = Source("prefill", pair.p.blocks.base, 256, tuple(pair.p.compute("p-1", "t-1", 2)))
    pair.fabric.stopped.add("prefill")  # the read stays pending
    pair.d.start("d-1", "t-1", 2, source)
    pair.d.step()
    reading = pair.d.stats()["held_blocks"]  # the scheduler's allocation and the load's pin
    if give_up == "abort":
        pair.d.abort("d-1")
    else:
        pair.clock.advance(1.5)  # past transfer_timeout
        pair.d.step()
    d = pair.d
    assert d.tracker.state("d-1") == ("aborting" if give_up == "abort" else "expiring")
    assert d.stats()["held_blocks"] == reading, "unpinned while the read may still write the blocks"
    assert "d-1" not in d.driver.report.take().recving, "reported to vLLM while the read may still write"
    pair.fabric.stopped.discard("prefill")  # the read lands now, into blocks the load still holds
    pair.d.step()
    assert d.outcomes == {"aborted" if give_up == "abort" else "expired": 1}
    assert d.stats()["held_blocks"] == 0 and d.blocks.pool.num_free == 16


def test_acks_is_the_specs_count_of_ranks_and_a_spec_that_cannot_take_it_refuses() -> None:
    fabric = Fabric()
    p = PrefillEngine(PlaneTransport(fabric.agent("p")), 4, 256, mode="read", acks=2)
    d = DecodeEngine(PlaneTransport(fabric.agent("d")), 4, 256, "p", acks=2)
    assert p.tracker.params["readers"].value == 2 and d.tracker.params["writers"].value == 2
    assert p.counted == {"release"} and d.counted == {"write_done", "released"}
    with pytest.raises(ValueError, match="disagree"):
        PrefillEngine(PlaneTransport(fabric.agent("p2")), 4, 256, mode="read", acks=2, params={"readers": 3})
    with pytest.raises(ValueError, match="does not count 'release'"):
        PrefillEngine(
            PlaneTransport(fabric.agent("p3")), 4, 256, mode="read", acks=2, spec=pre_fix_spec("read_producer")
        )


@pytest.mark.parametrize("other_rank", [True, False], ids=["other_rank_releases", "deadline"])
def test_read_mode_a_release_repeated_by_one_decode_rank_never_frees_the_blocks_another_rank_reads(
    other_rank: bool,
) -> None:
    """Decode TP = 2 × prefill TP: two decode ranks read one prefill rank's blocks, and rank 0's release comes twice.

    The repeat is a ``duplicate``, never the second reader: the blocks stay held until rank 1's release, or the
    reaper's deadline."""
    fabric, clock = Fabric(), VirtualClock()
    p = PrefillEngine(
        PlaneTransport(fabric.agent("prefill")), 16, 256, mode="read", acks=expected_acks(2, 1), clock=clock,
        params={"defer_timeout": 2.0},
    )  # fmt: skip
    twice = faulty(fabric.agent("decode-0"), FaultPlan(1.0, ["duplicate_release"]))
    d0, d1 = (
        DecodeEngine(t, 16, 256, "prefill", mode="read", rank=rank, clock=clock, params={"transfer_timeout": 1.0})
        for rank, t in enumerate([PlaneTransport(twice), PlaneTransport(fabric.agent("decode-1"))])
    )
    assert isinstance(p.blocks, KVBlocks)
    source = Source("prefill", p.blocks.base, 256, tuple(p.compute("p-1", "t-1", 2)))
    d0.start("d-0", "t-1", 2, source)
    d0.step()  # read, checked, release sent twice
    p.step()
    assert d0.outcomes == {"loaded": 1} and twice.injected == {"duplicate_release": 1}
    assert p.tracker.state("p-1") == "held" and p.stats()["held_blocks"] == 2
    assert p.counts["release"] == 2 and p.anomalies == {"duplicate:request_id": 1}
    if other_rank:
        d1.start("d-1", "t-1", 2, source)
        d1.step()
        p.step()
        assert d1.outcomes == {"loaded": 1} and p.outcomes == {"released": 1}
    else:
        clock.advance(2.5)
        p.step()
        assert p.outcomes == {"expired": 1}
    assert p.stats()["held_blocks"] == 0


@pytest.mark.parametrize("other_rank", [True, False], ids=["other_rank_writes", "deadline"])
def test_write_mode_a_write_done_repeated_by_one_prefill_rank_never_finishes_a_load_another_rank_writes(
    other_rank: bool,
) -> None:
    """Prefill TP = 2 × decode TP: two prefill ranks write into one decode rank's blocks, and rank 0's write_done
    comes twice. The repeat is a ``duplicate``, never the second writer: the load waits for rank 1's write_done,
    or its deadline (the blocks then reported invalid)."""
    fabric, clock = Fabric(), VirtualClock()
    timeouts = {"defer_timeout": 1.0, "transfer_timeout": 1.0}
    twice = faulty(fabric.agent("prefill-0"), FaultPlan(1.0, ["duplicate_write_done"]))
    p0, p1 = (
        PrefillEngine(t, 16, 256, rank=rank, clock=clock, params=timeouts)
        for rank, t in enumerate([PlaneTransport(twice), PlaneTransport(fabric.agent("prefill-1"))])
    )
    d = DecodeEngine(
        PlaneTransport(fabric.agent("decode")), 16, 256, "prefill-0", acks=expected_acks(2, 1), clock=clock,
        params={"recv_timeout": 3.0},
    )  # fmt: skip
    p0.compute("p-1", "t-1", 2)
    p1.compute("p-1", "t-1", 2)
    blocks = d.start("d-1", "t-1", 2)  # remote_blocks to prefill-0
    p0.step()  # written, write_done sent twice
    assert d.step().recving == set()
    assert p0.outcomes == {"written": 1} and twice.injected == {"duplicate_write_done": 1}
    assert d.counts["write_done"] == 2 and d.anomalies == {"duplicate:request_id": 1}
    assert d.tracker.state("d-1") == "waiting" and d.driver.stats["blocks_verified"] == 0
    if other_rank:
        assert isinstance(d.blocks, KVBlocks)
        p1.on_message(RemoteBlocks("t-1", "decode", d.blocks.base, 256, blocks))  # the same announcement, rank 1
        p1.step()
        done = d.step()
        assert p1.outcomes == {"written": 1} and d.outcomes == {"loaded": 1}
        assert done.recving == {"d-1"} and not done.invalid_blocks and d.stats()["verified_blocks"] == 2
    else:
        clock.advance(3.5)
        done = d.step()
        assert d.outcomes == {"expired": 1} and done.invalid_blocks == set(blocks)
    assert d.stats()["held_blocks"] == 0


def test_a_late_or_unknown_completion_is_an_anomaly_not_an_error() -> None:
    pair = Pair()
    pair.p.compute("p-1", "t-1", 2)
    pair.d.start("d-1", "t-1", 2)
    pair.step()
    pair.step()
    for tid in ("t-1", "t-unknown"):
        pair.d.on_message(WriteDone(tid))
        pair.p.on_message(RemoteBlocks(tid, "decode", pair.d.blocks.base, 256, [0, 1]))
    pair.step()
    assert pair.d.errors == [] and pair.p.errors == []
    assert pair.d.anomalies and pair.p.anomalies


def test_malformed_messages_are_dropped_and_counted() -> None:
    pair = Pair()
    stranger = pair.fabric.agent("stranger")  # a peer on the fabric sending what no MoRIIO engine would
    for raw in [b"", b"\x00", b"\x81\xa4type\xa7nothing", encode(WriteDone("t"))[:-2]]:
        assert decode(raw) is None
        stranger.send_notif("decode", raw)
    pair.d.step()
    assert pair.d.transport.dropped["malformed"] == 4


def test_a_stopped_peer_is_bounded_by_transfer_timeout_and_frees_everything() -> None:
    pair = Pair()
    pair.p.compute("p-1", "t-1", 2)
    pair.fabric.stopped.add("decode")
    pair.p.on_message(RemoteBlocks("t-1", "decode", pair.d.blocks.base, 256, [0, 1]))
    pair.p.step()
    assert pair.p.tracker.state("p-1") == "writing"
    pair.clock.advance(1.5)
    pair.p.step()
    assert pair.p.outcomes == {"expired": 1} and pair.p.stats()["held_blocks"] == 0
    assert pair.fabric.agents["prefill"].live_handles() == 0


# -- under load -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["write", "read"])
def test_600_requests_at_concurrency_128_with_10_percent_faults_leak_and_hang_nothing(mode: str) -> None:
    result = embedded_run(mode, requests=600, concurrency=128, fault_rate=0.1)
    assert result.finished == 600
    assert result.leaked_blocks == 0 and result.hung == 0 and result.late == 0
    assert sum(result.faults.values()) >= 40
    loaded = result.decode["outcomes"].get("loaded", 0)
    assert result.decode["verified_blocks"] == 2 * loaded > 0


def test_a_dead_prefill_mid_run_still_finishes_every_request_within_its_deadline() -> None:
    result = embedded_run("write", requests=256, concurrency=128, fault_rate=0.0, kill_after=20)
    assert result.finished == 256 and result.late == 0
    assert result.decode["held_blocks"] == 0 and result.decode["live"] == 0
    assert result.decode["outcomes"].get("expired", 0) > 0


def test_seed_001_the_pre_fix_prefill_hangs_at_concurrency_512_and_the_fix_does_not() -> None:
    lost = ["lost_remote_blocks"]
    before = embedded_run(
        "write", requests=2048, concurrency=512, fault_rate=0.1, faults=lost, prefill=PRE_FIX_PREFILL,
        clock=VirtualClock(),
    )  # fmt: skip
    assert before.hung > 100 and before.leaked_blocks > 200  # stuck in `deferred` for good, blocks held
    assert before.prefill["live"] == before.faults["lost_remote_blocks"]
    # On a virtual clock: on the wall clock a step the machine delays past defer_timeout expires holds whose
    # remote_blocks came late, and the count below is only a bound.
    after = embedded_run("write", requests=2048, concurrency=512, fault_rate=0.1, faults=lost, clock=VirtualClock())
    assert after.hung == 0 and after.leaked_blocks == 0 and after.finished == 2048
    assert after.prefill["outcomes"]["expired"] == after.faults["lost_remote_blocks"]


def test_the_pre_fix_spec_is_well_formed_but_refused_by_load() -> None:
    spec = pre_fix_spec("write_producer")
    assert spec.states["deferred"].timeout is None
    with pytest.raises(kvfsm.SpecError, match="KVF107"):
        kvfsm.load(SPECS / "write_producer_pre_fix.yaml")


def test_fault_plan_is_deterministic_and_one_fault_per_transfer() -> None:
    plan = FaultPlan(0.1, ["lost_release", "failed_read"], seed=7)
    ids = [f"t{i}" for i in range(2000)]
    assert plan.count(ids) == FaultPlan(0.1, ["lost_release", "failed_read"], seed=7).count(ids)
    assert 150 < sum(plan.count(ids).values()) < 250
    with pytest.raises(ValueError, match="unknown faults"):
        FaultPlan(0.1, ["typo"])


# -- vLLM's cache as the blocks, and the guards the real-engine connector relies on ------------


def _cache_pair() -> tuple[PrefillEngine, DecodeEngine, KVCache]:
    """A prefill on kvfsm's own blocks, a decode on a cache laid out like vLLM's: one layer's tensor block-major
    (one run per block), the other FlashAttention-style ``[2, blocks, ...]`` (K and V apart: two runs per block)."""
    fabric = Fabric()
    clock = VirtualClock()
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)  # 512 B a block
    cache = KVCache.of_layers([torch.zeros(16, 4, 2, 8), torch.zeros(2, 16, 4, 8)], 16, layout)
    p = PrefillEngine(
        PlaneTransport(fabric.agent("prefill")),
        16,
        512,
        clock=clock,
        params={"defer_timeout": 1.0, "transfer_timeout": 1.0},
    )
    d = DecodeEngine(
        PlaneTransport(fabric.agent("decode")), 16, 512, "prefill", clock=clock, params={"recv_timeout": 3.0},
        blocks=CacheBlocks(cache), bound_writes=True,
    )  # fmt: skip
    d.borrow_from("vllm")  # vLLM's allocator owns every block; the load pins on top
    return p, d, cache


def _steps(p: PrefillEngine, d: DecodeEngine, n: int = 3) -> None:
    for _ in range(n):
        p.step()
        d.step()


def test_writes_land_where_the_decode_sides_layout_says_in_a_cache_of_per_layer_tensors() -> None:
    p, d, cache = _cache_pair()
    src = p.compute("p-1", "t-1", 2)
    d.load("d-1", "t-1", [5, 9])  # vLLM's scheduler allocated these
    _steps(p, d)
    assert d.outcomes == {"loaded": 1} and p.outcomes == {"written": 1}
    assert isinstance(p.blocks, KVBlocks)
    for s, t in zip(src, [5, 9], strict=True):
        assert cache.block_bytes(t) == p.blocks.tensor[s].numpy().tobytes()
    assert all(not any(cache.block_bytes(b)) for b in range(16) if b not in (5, 9))
    # One write per contiguous run on both sides: 1 for the first layer, 2 (K, V) for the second, per block.
    assert p.driver.stats["extents_posted"] == 6 and p.driver.stats["bytes_written"] == 2 * 512
    assert d.stats()["held_blocks"] == 0 and d.blocks.pool.holdings() == {"vllm": tuple(range(16))}
    assert d.driver.stats["blocks_unchecked"] == 2  # vLLM's cache holds the model's KV: the tokens check it


def test_a_decode_side_that_has_the_first_blocks_gets_the_last_computed_ones() -> None:
    p, d, cache = _cache_pair()
    src = p.compute("p-1", "t-1", 3)
    d.load("d-1", "t-1", [7])  # its prefix cache held the first two blocks
    _steps(p, d)
    assert d.outcomes == {"loaded": 1}
    assert isinstance(p.blocks, KVBlocks)
    assert cache.block_bytes(7) == p.blocks.tensor[src[-1]].numpy().tobytes()


def test_remote_blocks_whose_decode_side_stops_waiting_too_soon_are_refused_and_nothing_is_written() -> None:
    p, d, cache = _cache_pair()
    p.compute("p-1", "t-1", 2)
    d.load("d-1", "t-1", [5, 9])  # write_by: 3 s from now (recv_timeout)
    assert isinstance(p.driver, BlockWriter)
    p.driver.wall = lambda: time.time() + 2.5  # the message reaches the prefill 2.5 s later: 0.5 s left, writes take 1
    _steps(p, d)
    assert p.outcomes == {"failed": 1} and p.stats()["held_blocks"] == 0
    assert "sooner than a write may take" in str(p.errors[0].__cause__)
    assert not any(cache.block_bytes(5)) and not any(cache.block_bytes(9))
    assert d.tracker.state("d-1") == "waiting"  # and it ends at its own deadline


@pytest.mark.parametrize("computed_first", [True, False])
def test_an_aborted_decode_load_tells_the_prefill_which_frees_its_blocks_and_never_writes(computed_first: bool) -> None:
    p, d, cache = _cache_pair()
    if computed_first:
        p.compute("p-1", "t-1", 2)
    d.load("d-1", "t-1", [5, 9])
    d.abort("d-1")  # remote_blocks and release reach the prefill in one batch: release goes first
    _steps(p, d)
    if not computed_first:
        p.compute("p-1", "t-1", 2)
        _steps(p, d)
    assert d.outcomes == {"aborted": 1} and p.outcomes == {"aborted": 1}
    assert p.driver.stats["batches_posted"] == 0  # not even posted: on a real fabric it could land at once
    assert p.stats()["held_blocks"] == 0 and d.stats()["held_blocks"] == 0 and p.tracker.live() == 0
    assert not any(cache.block_bytes(5)) and not any(cache.block_bytes(9))
    assert d.anomalies == {}  # no write_done came for blocks given back


@pytest.mark.parametrize("apart", [False, True], ids=["one_batch", "steps_apart"])
def test_a_release_before_the_forward_pass_aborts_the_hold_as_it_begins_and_nothing_is_written(apart: bool) -> None:
    """The decode side announces its blocks, then gives up, before the prefill has computed the transfer.

    Both messages wait in the tracker (``early:``) and are applied at hold, oldest first: even when the
    ``remote_blocks`` came a step earlier and so is applied first, its writes are withdrawn unposted."""
    p, d, cache = _cache_pair()
    d.load("d-1", "t-1", [5, 9])
    if apart:
        _steps(p, d, 1)
        assert p.tracker.counts["kept_early"] == 1
    d.abort("d-1")
    _steps(p, d, 1)
    assert p.tracker.counts["kept_early"] == 2 and p.tracker.live() == 0
    p.compute("p-1", "t-1", 2)
    _steps(p, d)
    assert d.outcomes == {"aborted": 1} and p.outcomes == {"aborted": 1}
    assert p.driver.stats["batches_posted"] == 0  # not even posted: on a real fabric it could land at once
    assert p.driver.stats["batches_withdrawn"] == (1 if apart else 0)  # one batch: the release went first
    assert p.stats()["held_blocks"] == 0 and p.tracker.counts["early"] == 0
    assert not any(cache.block_bytes(5)) and not any(cache.block_bytes(9))


def test_an_aborted_load_keeps_its_blocks_while_the_prefill_writes_and_frees_them_on_its_answer() -> None:
    """The prefill has the blocks' address and is writing when the decode request is aborted (the race a loaded
    machine showed in two real engines): the load keeps its blocks and its report until the prefill's writes
    have landed and it has answered ``released``; only then are the blocks given back."""
    pair = Pair()
    p, d = pair.p, pair.d
    src = p.compute("p-1", "t-1", 2)
    dst = d.start("d-1", "t-1", 2)
    pair.fabric.stopped.add("decode")  # the writes stay in flight
    p.step()
    assert p.tracker.state("p-1") == "writing"
    held = d.stats()["held_blocks"]
    d.abort("d-1")
    p.step()
    assert p.tracker.state("p-1") == "draining"  # a posted write cannot be recalled
    for _ in range(2):
        d.step()
        assert d.tracker.state("d-1") == "aborting" and d.stats()["held_blocks"] == held
    pair.fabric.stopped.discard("decode")  # the writes land now, into blocks the load still holds
    pair.step()
    assert p.outcomes == {"aborted": 1} and p.driver.stats["released_sent"] == 1
    assert d.outcomes == {"aborted": 1} and d.counts["released"] == 1
    assert isinstance(p.blocks, KVBlocks) and isinstance(d.blocks, KVBlocks)
    assert [d.blocks.tensor[b].tolist() for b in dst] == [p.blocks.tensor[b].tolist() for b in src]
    assert d.stats()["held_blocks"] == 0 and p.stats()["held_blocks"] == 0 and d.blocks.pool.num_free == 16
    assert d.anomalies == {} and p.anomalies == {}


@pytest.mark.parametrize("how", ["lost", "raised"])
def test_a_release_the_prefill_never_hears_keeps_the_blocks_until_the_loads_deadline(how: str) -> None:
    """Without an answer the blocks stay held until the deadline ``write_by`` names (no write may be in flight
    past it): a ``release`` lost on the way, or one whose send raised (the load is ``aborting`` all the same)."""
    pair = Pair()
    d = pair.d
    d.start("d-1", "t-1", 2)
    held = d.stats()["held_blocks"]
    if how == "lost":
        pair.fabric.stopped.add("prefill")
    else:

        def refuse(peer: str, message: object) -> None:
            raise ConnectionError(f"{peer} unreachable")

        d.transport.notify = refuse  # type: ignore[method-assign]
    d.abort("d-1")
    assert d.tracker.state("d-1") == "aborting" and d.stats()["held_blocks"] == held
    assert len(d.errors) == (1 if how == "raised" else 0)
    pair.clock.advance(2.9)
    d.step()
    assert d.tracker.state("d-1") == "aborting" and "d-1" not in d.driver.report.take().recving
    pair.clock.advance(0.2)  # past recv_timeout (3 s) from the announce: the `load` phase
    finished = d.step()
    assert d.outcomes == {"expired": 1} and "d-1" in finished.recving
    assert d.stats()["held_blocks"] == 0 and d.blocks.pool.num_free == 16


def test_a_hold_or_a_load_that_cannot_begin_is_still_reported_so_vllm_never_waits_for_it() -> None:
    p, d, _ = _cache_pair()
    p.borrow_from("vllm")
    p.hold("p-1", "t-1", [3, 3])  # the pool refuses a block named twice: hold_blocks raises
    d.load("d-1", "t-1", [5, 5])  # and pin_dst
    assert p.errors and d.errors
    assert p.step().sending == {"p-1"}
    done = d.step()
    assert done.recving == {"d-1"} and done.invalid_blocks == {5}


def test_a_read_that_cannot_begin_is_reported_and_its_blocks_freed() -> None:
    """READ mode: the prefill computed fewer blocks than decode allocated, so pin_dst refuses at begin. The
    report is owed before the pin (the spec's first acquire), so undoing it reports the load, and the blocks
    :meth:`start` allocated go back once it is reported."""
    fabric = Fabric()
    d = DecodeEngine(PlaneTransport(fabric.agent("decode")), 8, 256, "prefill", mode="read")
    source = Source("prefill", 0, 256, (1,))  # one remote block for two local ones
    blocks = d.start("d-1", "t-1", 2, source)
    assert d.errors and d.tracker.state("d-1") is None
    done = d.step()
    assert done.recving == {"d-1"} and done.invalid_blocks == set(blocks)
    assert d.blocks.pool.num_free == 8 and d.step().recving == set()


def test_the_runner_plug_gives_both_requests_of_a_prompt_one_transfer_id_in_either_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVFSM_MORIIO_NOTIFY_PORT", "23456")
    from kvfsm.adapters.vllm_moriio_pd import MoRIIOPD

    plug = MoRIIOPD()
    decode = plug.decode_params("7", None)  # concurrent: the decode request goes out first
    prefill = plug.prefill_params("7")
    assert decode["transfer_id"] == prefill["transfer_id"] and decode["remote_notify_port"] == 23456
    again = plug.prefill_params("7")  # a later phase, prefill first: a new transfer
    assert again["transfer_id"] != prefill["transfer_id"]
    back = {**again, "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_notify_port": 23456}
    assert plug.decode_params("7", back)["transfer_id"] == again["transfer_id"]


def test_the_soak_benchmarks_bare_drivers_bind_to_the_bundled_specs() -> None:
    """``benchmarks/moriio_soak.py --overhead`` times the trackers with empty actions: its driver must keep up with
    the specs' actions, or the figure it reports is an error."""
    script = Path(__file__).parent.parent / "benchmarks" / "moriio_soak.py"
    out = subprocess.run([sys.executable, str(script), "--overhead"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kvfsm_us_per_request_bare"] > 0
