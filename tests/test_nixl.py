"""The NIXL drivers on the embedded transport: notification ids, TP counting, expiry, faults, seed 004 at run time."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

pytest.importorskip("torch")

from kvfsm.drivers.nixl import DecodeRank, Fabric, PeerInfo, PrefillRank, Topology, encode, parse
from kvfsm.drivers.nixl.decode import BlockReader
from kvfsm.showcase.bench.nixl import soak
from kvfsm.showcase.nixl_seed import LocalIdReader


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """One prefill engine and the decode ranks of a topology on one fabric, with a shared fake clock."""

    def __init__(self, topology: Topology, reader: type[BlockReader] = BlockReader) -> None:
        self.fabric = Fabric()
        self.clock = Clock()
        self.topology = topology
        self.prefill = [
            PrefillRank(r, topology, self.fabric.agent(f"p{r}"), 32, params={"abort_timeout": 480.0}, clock=self.clock)
            for r in range(topology.prefill_tp)
        ]
        self.decode = [
            DecodeRank(d, topology, self.fabric.agent(f"d{d}"), 32, params={"read_timeout": 5.0}, clock=self.clock,
                       reader=reader)
            for d in range(topology.decode_tp)
        ]  # fmt: skip
        peers = [PeerInfo("E", p.rank, p.agent.name, p.agent.metadata(), p.blocks.base, p.blocks.block_bytes)
                 for p in self.prefill]  # fmt: skip
        for d in self.decode:
            d.handshake(peers)

    def request(self, rid: str, n: int = 3) -> None:
        remote = []
        for p in self.prefill:
            blocks = p.compute(rid, n)
            p.request_finished(rid, blocks)
            remote.append(blocks)
        for d in self.decode:
            local = d.blocks.pool.allocate(f"d{d.rank}-{rid}", n)
            group = self.topology.group(d.rank)
            d.start_load(f"d{d.rank}-{rid}", rid, "E", local, remote[group[0]])

    def step(self) -> None:
        for d in self.decode:
            for key in d.step().recving:
                d.blocks.pool.release(key)
        for p in self.prefill:
            p.step()

    def held(self) -> list[int]:
        return [p.held_requests() for p in self.prefill]

    def leaked(self) -> int:
        return sum(len(d.leaked()) for d in self.decode) + sum(len(p.leaked()) for p in self.prefill)


def test_notification_names_the_prefill_request_and_the_decode_world_size() -> None:
    assert encode("p-7:x", 4) == b"p-7:x:4"
    assert parse(b"p-7:x:4") is not None and parse(b"p-7:x:4").request_id == "p-7:x"  # type: ignore[union-attr]


@pytest.mark.parametrize("raw", [b"no-colon", b"p-1:", b":4", b"p-1:four", b"p-1:0", b"p-1:-2", b"\xff\xfe:1", b""])
def test_malformed_notification_parses_to_none_instead_of_raising(raw: bytes) -> None:
    assert parse(raw) is None


def test_mla_read_of_one_rank_frees_every_prefill_rank_at_once() -> None:
    c = Cluster(Topology(prefill_tp=4, decode_tp=1, mla=True, kv_bytes=256))
    c.request("p-1")
    c.step()
    assert c.decode[0].outcomes == {"loaded": 1}
    assert c.held() == [0, 0, 0, 0]
    assert [dict(p.outcomes) for p in c.prefill] == [{"read": 1}] * 4
    assert c.leaked() == 0


def test_a_load_whose_pin_refuses_is_reported_once_and_holds_nothing() -> None:
    """More local blocks than the prefill computed: pin_dst refuses at begin. vLLM's start_load_kv must not
    raise, and the load it waits for is reported all the same (undoing recv_report, acquired before the pin)."""
    fabric = Fabric()
    topology = Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256)
    decode = DecodeRank(0, topology, fabric.agent("d"), 8)
    local = decode.blocks.pool.allocate("d-1", 3)
    decode.start_load("d-1", "p-1", "E", local, [4, 5])
    assert decode.errors and decode.tracker.state("d-1") is None
    done = decode.step()
    assert done.recving == {"d-1"} and done.invalid_blocks == set(local)
    assert decode.leaked() == {} and decode.step().recving == set()


def test_a_hold_the_pool_refuses_is_reported_finished_sending_and_not_raised() -> None:
    """vLLM keeps a request's blocks (delay_free) until finished_sending names it: a hold that cannot begin
    (a block named twice) is reported all the same, and start_load_kv does not raise."""
    fabric = Fabric()
    topology = Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256)
    prefill = PrefillRank(0, topology, fabric.agent("p"), 8)
    prefill.blocks.pool.allocate("vllm", 8)
    prefill.hold("p-1", [3, 3])
    assert prefill.errors and prefill.tracker.state("p-1") is None
    assert prefill.step().sending == {"p-1"} and prefill.step().sending == set()
    assert prefill.blocks.pool.holdings() == {"vllm": tuple(range(8))}


def test_seed_004_local_id_holds_the_skipped_ranks_until_expiry() -> None:
    c = Cluster(Topology(prefill_tp=4, decode_tp=1, mla=True, kv_bytes=256), reader=LocalIdReader)
    c.request("p-1")
    c.step()
    assert c.decode[0].outcomes == {"loaded": 1}
    assert c.held() == [0, 1, 1, 1], "only the rank that was read frees its blocks"
    for p in c.prefill[1:]:  # the id may yet begin (read is early): kept, not dropped yet
        assert p.stats()["kept_early"] == 1 and not p.anomalies
    c.clock.now = 5.0  # early_within: the decode-local id never began on the skipped ranks
    c.step()
    assert c.held() == [0, 1, 1, 1]
    for p in c.prefill[1:]:
        assert p.anomalies == {"early:request_id": 1}
        assert list(p.anomaly_ids) == ["d0-p-1"], "the id is decode's key, not a prefill request id"
    c.clock.now = 480.0
    c.step()
    assert c.held() == [0, 0, 0, 0]
    assert [dict(p.outcomes) for p in c.prefill[1:]] == [{"expired": 1}] * 3
    assert c.leaked() == 0


def test_decode_tp_above_prefill_tp_frees_only_after_every_reader_notified() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=4, mla=False, kv_bytes=256))
    c.request("p-1")
    c.decode[0].step(), c.decode[1].step(), c.decode[2].step()
    c.prefill[0].step()
    assert c.held() == [1] and c.prefill[0].stats()["partial"] == 3
    c.step()
    assert c.held() == [0] and c.prefill[0].outcomes == {"read": 1}
    assert all(d.outcomes == {"loaded": 1} for d in c.decode), "each decode rank byte-checked its slice of the heads"


def test_a_reader_heard_twice_is_a_duplicate_not_a_second_reader() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=2, mla=False, kv_bytes=256))
    c.request("p-1")
    c.decode[0].step()
    c.decode[0].agent.send_notif(c.prefill[0].agent.name, encode("p-1", 2))  # the same reader again
    c.prefill[0].step()
    assert c.held() == [1], "decode rank 1 may still be reading"
    assert c.prefill[0].stats()["duplicate"] == 1
    c.step()
    assert c.held() == [0] and c.prefill[0].outcomes == {"read": 1}


def test_prefill_tp_above_decode_tp_without_mla_reads_every_rank_of_the_group() -> None:
    c = Cluster(Topology(prefill_tp=4, decode_tp=2, mla=False, kv_bytes=256))
    c.request("p-1")
    c.step()
    assert [d.outcomes for d in c.decode] == [{"loaded": 1}] * 2
    assert c.held() == [0, 0, 0, 0] and c.leaked() == 0


def test_notifications_for_ids_never_begun_or_malformed_are_counted_and_dropped() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256))
    c.request("p-1")
    d0 = c.fabric.agents["d0"]
    for raw in (b"garbage", b"p-1:zero", b"nobody:1", b"p-1:1", b"p-1:1"):
        d0.send_notif("p0", raw)
    c.prefill[0].step()
    assert c.prefill[0].counts["malformed"] == 2
    assert c.prefill[0].stats()["kept_early"] == 1, "'nobody' may yet begin: kept for early_within"
    c.clock.now = 5.0
    c.step()
    assert c.prefill[0].anomalies["early:request_id"] == 1
    assert c.held() == [0] and c.leaked() == 0


def test_hung_peer_read_expires_but_keeps_the_blocks_until_the_read_stops() -> None:
    """Releasing a NIXL handle does not cancel its READ (docs/nixl.md §6): at the deadline the load gives up
    but keeps its blocks pinned and unreported while the READ may still land; the READ landing ends it."""
    c = Cluster(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256))
    c.fabric.stop("p0")
    c.request("p-1")
    c.step()
    d = c.decode[0]
    assert d.tracker.state("d0-p-1") == "reading"
    c.clock.now = 5.0
    c.step()
    assert d.tracker.state("d0-p-1") == "expiring" and d.reading() == ["d0-p-1"]
    assert d.blocks.pool.held_by(d.driver.holder("d0-p-1")), "unpinned while its READ may still write"
    assert d.driver.owes("d0-p-1"), "reported to vLLM (which reuses the blocks) while its READ may still write"
    assert c.fabric.agents["d0"].live_handles() == 1
    c.fabric.resume("p0")  # the READ lands now, into blocks the request still holds
    done = d.step()
    assert d.outcomes == {"expired": 1} and d.read_outcomes == {"done": 1}
    assert done.recving == {"d0-p-1"} and len(done.invalid_blocks) == 3
    assert c.fabric.agents["d0"].live_handles() == 0
    c.clock.now = 480.0
    c.step()
    assert c.held() == [0] and c.leaked() == 0


def test_one_of_several_reads_failing_ends_the_load_only_after_the_others_have_stopped() -> None:
    """Prefill TP 3 into decode TP 1: three READs in flight. One peer dies (its READ breaks), one is stopped
    (its READ may land at any time): the load fails at once but keeps its blocks until the stopped READ is
    DONE; the engine's own pool is whole afterwards."""
    c = Cluster(Topology(prefill_tp=3, decode_tp=1, mla=False, kv_bytes=384))
    d = c.decode[0]
    c.fabric.stop("p1")
    c.request("p-1")
    assert len(d.tracker.owned("d0-p-1")) == 3
    c.fabric.kill("p2")
    c.step()
    assert d.tracker.state("d0-p-1") == "failing" and d.read_outcomes == {"done": 1, "broken": 1}
    assert d.blocks.pool.held_by(d.driver.holder("d0-p-1")) and d.driver.owes("d0-p-1")
    c.clock.now = 100.0  # no deadline frees it either: only the READ stopping does
    c.step()
    assert d.tracker.state("d0-p-1") == "failing" and d.reading() == ["d0-p-1"]
    c.fabric.resume("p1")
    c.step()
    assert d.outcomes == {"failed": 1} and d.read_outcomes == {"done": 2, "broken": 1}
    assert d.leaked() == {} and c.fabric.agents["d0"].live_handles() == 0
    assert d.blocks.pool.num_free == 32, "the engine's pool is not whole"


def test_hung_peer_that_dies_ends_the_expired_load() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256))
    c.fabric.stop("p0")
    c.request("p-1")
    c.step()
    c.clock.now = 5.0
    c.step()
    c.fabric.kill("p0")  # a dead peer's READ cannot write any more: check_xfer_state answers ERR
    c.step()
    assert c.decode[0].outcomes == {"expired": 1} and c.decode[0].read_outcomes == {"broken": 1}
    assert c.fabric.agents["d0"].live_handles() == 0 and c.decode[0].leaked() == {}


def test_dead_peer_fails_the_load_and_reports_its_blocks_invalid() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256))
    c.fabric.kill("p0")
    c.request("p-1")
    done = c.decode[0].step()
    assert c.decode[0].outcomes == {"failed": 1}
    assert done.recving == {"d0-p-1"} and len(done.invalid_blocks) == 3


def test_abort_mid_read_releases_the_handle_and_the_prefill_expiry_frees_the_rest() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256))
    c.request("p-1")
    c.decode[0].abort("d0-p-1")
    c.step()
    assert c.decode[0].outcomes == {"aborted": 1} and c.fabric.agents["d0"].live_handles() == 0
    c.clock.now = 480.0
    c.step()
    assert c.held() == [0] and c.leaked() == 0


def test_corrupted_block_fails_the_byte_check() -> None:
    c = Cluster(Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=256))
    c.request("p-1")
    c.prefill[0].blocks.tensor[c.prefill[0].blocks.pool.held_by(("nixl_send", "p-1"))[1]] ^= 1
    done = c.decode[0].step()
    assert c.decode[0].outcomes == {"failed": 1}
    assert "do not hold 'p-1'" in str(c.decode[0].errors[0].__cause__ or c.decode[0].errors[0])
    assert len(done.invalid_blocks) == 3


def test_embedded_soak_with_faults_leaks_nothing_and_hangs_nothing() -> None:
    result = soak(requests=300, concurrency=128, fault_rate=0.1, real=False, abort_timeout=0.3, read_timeout=1.0)
    assert result.ok, result
    assert sum(result.faults.values()) > 0 and result.blocks_verified > 0


# -- seed 004 caught before it runs, and in the journals when it does ------------------------------------------------


def test_kvfsm_test_fails_the_seed_reader_naming_the_id_and_both_spaces_and_passes_the_correct_one() -> None:
    from kvfsm.drivers.nixl import decode_spec, read_spec
    from kvfsm.showcase.nixl_seed import correct_reader, reads, seed_reader
    from kvfsm.testing import run

    caught = run(decode_spec(), seed_reader, seed=1, examples=20, owned=(read_spec(), reads))
    assert not caught.passed
    assert caught.story[-1].endswith(
        "sent read to nixl_prefill with 'req-1', the key (space request_id); "
        "the spec says it carries remote_request_id, linked to 'p-1'"
    ), "\n".join(caught.story)
    report = run(decode_spec(), correct_reader, seed=1, examples=20, owned=(read_spec(), reads))
    assert report.passed, "\n".join(report.story) or report.error


PARAMS = {"abort_timeout": 5.0, "early_within": 1.0}


@pytest.mark.parametrize("reader", [BlockReader, LocalIdReader], ids=["correct", "seed"])
def test_the_seed_readers_journals_fail_replay_limits_and_the_correct_ones_pass(tmp_path, reader) -> None:  # type: ignore[no-untyped-def]
    from kvfsm.cli import main
    from kvfsm.drivers.nixl import decode_spec, prefill_spec
    from kvfsm.replay import JsonlJournal, Limit, check_log

    topology = Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=64)
    fabric, clock = Fabric(), Clock()
    journals = [JsonlJournal(tmp_path / f"p{r}.jsonl", machine="nixl_prefill") for r in range(2)]
    prefill = [
        PrefillRank(r, topology, fabric.agent(f"p{r}"), 16, params=PARAMS, clock=clock,
                    observer=journals[r], on_anomaly=journals[r].anomaly)
        for r in range(2)
    ]  # fmt: skip
    djournal = JsonlJournal(tmp_path / "d0.jsonl", machine="nixl_decode")
    decode = DecodeRank(0, topology, fabric.agent("d0"), 16, clock=clock, reader=reader,
                        observer=djournal, on_anomaly=djournal.anomaly)  # fmt: skip
    decode.handshake([PeerInfo("E", p.rank, p.agent.name, p.agent.metadata(), p.blocks.base, p.blocks.block_bytes)
                      for p in prefill])  # fmt: skip
    for i in range(4):
        remote = [p.compute(f"p-{i}", 2) for p in prefill]
        for p, blocks in zip(prefill, remote, strict=True):
            p.request_finished(f"p-{i}", blocks)
        decode.start_load(f"d-{i}", f"p-{i}", "E", decode.blocks.pool.allocate(f"d-{i}", 2), remote[0])
    for now in (0.0, 6.0):  # the reads complete; the skipped ranks' early window and expiry pass
        clock.now = now
        decode.step()
        for p in prefill:
            p.step()
    assert decode.outcomes == {"loaded": 4}
    for journal in (*journals, djournal):
        journal.close()
    zero = {"early": Limit.parse("0"), "misaddressed": Limit.parse("0")}
    skipped = check_log(prefill_spec(), tmp_path / "p1.jsonl", limits=zero, params=PARAMS)
    sender = check_log(decode_spec(), tmp_path / "d0.jsonl", limits=zero)
    replay = ["replay", prefill_spec().path, str(tmp_path / "p1.jsonl"), "--param", "abort_timeout=5"]
    assert (main([*replay, "--max", "early=0"]) == 0) == (reader is BlockReader)  # kvfsm replay, as a CI runs it
    if reader is BlockReader:
        assert skipped.conforms and sender.conforms and prefill[1].outcomes == {"read": 4}
    else:  # the skipped rank never began the id it heard: early there after the window, misaddressed where it was sent
        assert not skipped.conforms and skipped.anomalies == {"early": 4} and prefill[1].outcomes == {"expired": 4}
        assert not sender.conforms and sender.anomalies == {"misaddressed": 4}


def test_kvfsm_test_holds_the_prefill_holder_to_its_spec_with_notifications_naming_ids_of_every_kind() -> None:
    from kvfsm.drivers.nixl import prefill_spec
    from kvfsm.showcase.nixl_seed import holder
    from kvfsm.testing import run

    report = run(prefill_spec(), holder, seed=3, examples=20)
    assert report.passed, "\n".join(report.story) or report.error
    assert report.coverage.unknown > 0  # notifications for ids this rank never held, or no longer holds


def test_the_kvfsm_test_command_prints_the_seed_readers_story_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfsm.cli import main
    from kvfsm.drivers.nixl import decode_spec

    argv = ["test", decode_spec().path, "--seed", "1", "--examples", "5", "--driver", "reads=" + SEED + "reads"]
    assert main([*argv, "--driver", SEED + "seed_reader"]) != 0
    out = capsys.readouterr().out
    assert "sent read to nixl_prefill with 'req-1', the key (space request_id); the spec says it carries " in out
    assert main([*argv, "--driver", SEED + "correct_reader"]) == 0


SEED = "kvfsm.showcase.nixl_seed:"


def test_a_read_between_vllm_shaped_caches_moves_each_layers_block_with_a_descriptor_per_run() -> None:
    import torch

    from kvfsm.drivers.kv_cache import KVCache, KVLayout
    from kvfsm.drivers.nixl import CacheBlocks

    # FlashAttention's per-layer shape [2, blocks, block_size, heads, head]: each layer's block is two runs, K and V.
    layout = KVLayout(num_layers=4, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
    torch.manual_seed(0)
    prefill_cache = KVCache.of_layers([torch.randn(2, 16, 4, 2, 8) for _ in range(2)], 16, layout)
    decode_cache = KVCache.of_layers([torch.zeros(2, 16, 4, 2, 8) for _ in range(2)], 16, layout)
    topology = Topology(prefill_tp=1, decode_tp=1, mla=False, kv_bytes=layout.block_bytes)
    fabric = Fabric()
    prefill = PrefillRank(0, topology, fabric.agent("p"), 16, blocks=CacheBlocks(prefill_cache))
    decode = DecodeRank(0, topology, fabric.agent("d"), 16, blocks=CacheBlocks(decode_cache))
    for rank in (prefill, decode):
        rank.blocks.pool.allocate("vllm", 16)
    decode.handshake([PeerInfo.of("E", 0, prefill.agent, prefill.blocks.layout)])
    prefill.hold("p-1", [3, 4])
    decode.start_load("d-1", "p-1", "E", [5, 9], [3, 4])
    decode.step()
    prefill.step()
    assert decode.outcomes == {"loaded": 1} and prefill.outcomes == {"read": 1}
    assert decode.driver.stats == {"reads": 1, "descriptors": 2 * 2 * 2, "blocks_read": 2}  # blocks × layers × K/V
    assert decode_cache.block_bytes(5) == prefill_cache.block_bytes(3)
    assert decode_cache.block_bytes(9) == prefill_cache.block_bytes(4)
    zero = bytes(layout.block_bytes)
    assert all(decode_cache.block_bytes(b) == zero for b in range(16) if b not in (5, 9)), "nothing else was written"


def test_read_extents_cut_where_either_sides_runs_end_and_refuse_blocks_that_differ() -> None:
    from kvfsm.drivers.nixl.memory import BlockLayout, Part, read_extents

    local = BlockLayout.contiguous(1000, 64)
    remote = BlockLayout((Part(5000, 16, ((0, 16),)), Part(9000, 48, ((0, 48),))))
    mine, theirs = read_extents(local, [2], 0, remote, [1], 0, 64)
    assert mine == [(1000 + 128, 16), (1000 + 128 + 16, 48)] and theirs == [(5000 + 16, 16), (9000 + 48, 48)]
    assert BlockLayout.from_json(remote.to_json()) == remote
    with pytest.raises(ValueError, match="the two sides' blocks do not match"):
        read_extents(local, [0], 0, BlockLayout.contiguous(0, 32), [0], 0, 64)


def test_kvfsm_test_catches_reads_that_unpin_their_request_when_the_first_one_ends() -> None:
    """The class the old driver was in: giving a request's blocks back when one of its READs gives up, while
    another may still write them. Here the first READ to end unpins them; the family test catches it."""
    from kvfsm.drivers.nixl import decode_spec, read_spec
    from kvfsm.showcase.nixl_seed import FabricReads, correct_reader
    from kvfsm.testing import run

    class UnpinsAtFirstEnd(FabricReads):
        def __init__(self, reader: BlockReader) -> None:
            super().__init__(reader)
            self.requests: dict[Hashable, Hashable] = {}

        def post_read(self, key: Hashable, /, request_id: Hashable, rank: int) -> None:
            super().post_read(key, request_id, rank)
            self.requests[key] = request_id

        def release_read(self, key: Hashable, /) -> None:
            super().release_read(key)
            request = self.requests.pop(key)
            if self.reader.observe(request) >= {"dst_blocks"}:  # the first of its READs to end
                self.reader.unpin_dst(request)

    caught = run(decode_spec(), correct_reader, seed=1, examples=50, owned=(read_spec(), UnpinsAtFirstEnd))
    assert not caught.passed
    story = "\n".join(caught.story)
    assert "unpin_dst() raised" in story or "dst_blocks" in story, story
