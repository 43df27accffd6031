"""Id spaces and remote events declared in the spec: linked by the engine, routed by the spec, late told from unknown.

The spec below is the prefill side of a NIXL-style read: prefill holds a
request's blocks until decode's notification names it — by prefill's own
request id, the id decode was told in the handshake, never decode's local one
(seed 004).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable

import pytest
from buggy_drivers import DECODE_READ, PREFILL_HOLD, HeldBlocks, Notifier

import kvfsm
from kvfsm import Tracker
from kvfsm.replay import JsonlJournal
from kvfsm.testing import VirtualClock

SPEC = PREFILL_HOLD


class Blocks:
    def __init__(self) -> None:
        self.held: set[Hashable] = set()

    def free_blocks(self, key: Hashable) -> None:
        self.held.discard(key)


def tracker(**kwargs: object) -> tuple[Tracker, Blocks]:
    blocks = Blocks()
    return Tracker(kvfsm.parse(SPEC, "prefill_hold.yaml"), blocks, clock=VirtualClock(), **kwargs), blocks  # type: ignore[arg-type]


def test_the_id_begin_carries_is_linked_and_a_message_is_routed_by_the_space_the_spec_names() -> None:
    t, blocks = tracker()
    blocks.held.add("p-7")
    t.begin("p-7", remote_request_id="r-42")
    assert t.ids("p-7") == {"remote_request_id": "r-42"}
    assert t.deliver("read_done", "r-42") == "done" and blocks.held == set()


def test_a_message_naming_the_local_id_is_unknown_and_frees_nothing() -> None:
    t, blocks = tracker()
    blocks.held.add("p-7")
    t.begin("p-7", remote_request_id="r-42")
    assert t.deliver("read_done", "p-7") is None  # the seed-004 shape: the wrong space's id
    assert t.state("p-7") == "held" and blocks.held == {"p-7"}
    [anomaly] = t.anomalies()
    assert (anomaly.kind, anomaly.space, anomaly.id) == ("unknown", "remote_request_id", "p-7")


def test_a_late_duplicate_is_late_not_unknown() -> None:
    t, _blocks = tracker()
    t.begin("p-7", remote_request_id="r-42")
    t.deliver("read_done", "r-42")
    t.finished()
    assert t.deliver("read_done", "r-42") is None
    assert (t.counts["late"], t.counts["unknown"]) == (1, 0)


def test_an_id_that_already_names_a_live_instance_fails_the_link_not_the_tracker() -> None:
    t, _blocks = tracker()
    t.begin("p-1", remote_request_id="r-1")
    with pytest.raises(kvfsm.ActionError) as caught:
        t.begin("p-2", remote_request_id="r-1")
    (failure,) = caught.value.failures
    assert failure.phase == "link" and t.state("p-2") == "held" and t.ids("p-1") == {"remote_request_id": "r-1"}


def test_anomalies_go_to_the_hook_and_a_rate_limited_log(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[kvfsm.Anomaly] = []
    t, _blocks = tracker(on_anomaly=seen.append)
    with caplog.at_level(logging.WARNING, logger="kvfsm.anomalies"):
        for i in range(50):
            t.deliver("read_done", f"nobody-{i}")
    assert len(seen) == 50 and {a.kind for a in seen} == {"unknown"}
    assert len(caplog.records) == 10  # the first ten, then every thousandth


def test_the_journal_records_anomalies_as_their_own_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "j.jsonl"
    journal = JsonlJournal(path, machine="prefill_hold")
    t, _blocks = tracker(observer=journal, on_anomaly=journal.anomaly)
    t.begin("p-7", remote_request_id="r-42")
    t.deliver("read_done", "p-7")
    journal.close()
    lines = path.read_text().splitlines()
    assert any('"anomaly":"unknown"' in line and '"space":"remote_request_id"' in line for line in lines)


def test_the_diagram_shows_which_id_a_message_carries() -> None:
    from kvfsm.gen.diagram import to_mermaid

    text = to_mermaid(kvfsm.parse(SPEC, "prefill_hold.yaml"))
    assert "read_done ⟨remote_request_id⟩" in text


# -- kvfsm test with id spaces: deliveries by space, and what a driver sends ------------------------------------------


def test_kvfsm_test_delivers_ids_of_every_space_and_generation_and_the_model_predicts_each_anomaly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvfsm.testing import oracle, run

    predicted: Counter[tuple[str, str]] = Counter()
    model_anomaly = oracle.SpecModel._anomaly

    def counted(
        self: oracle.SpecModel, out: oracle.Outcome, kind: str, space: str, ident: Hashable, event: str
    ) -> None:
        predicted[kind, space] += 1
        model_anomaly(self, out, kind, space, ident, event)

    monkeypatch.setattr(oracle.SpecModel, "_anomaly", counted)
    report = run(kvfsm.parse(SPEC, "prefill_hold.yaml"), HeldBlocks, seed=4, examples=60)
    assert report.passed, "\n".join(report.story) or report.error
    # every prediction was held to the Tracker's own anomalies, step by step; the run reached each kind
    assert report.coverage.edges["held", "read_done", "fire"] > 0
    for kind in ("unknown", "late", "stale"):
        assert predicted[kind, "remote_request_id"] > 0, predicted
    assert predicted["unknown", "request_id"] > 0 and predicted["late", "request_id"] > 0, predicted


def test_kvfsm_test_passes_a_notifier_that_sends_the_peers_id() -> None:
    from kvfsm.testing import run

    report = run(kvfsm.parse(DECODE_READ, "decode_read.yaml"), Notifier, seed=1, examples=30)
    assert report.passed, "\n".join(report.story) or report.error


def _story(report: object) -> str:
    return "\n".join(getattr(report, "story", ())) or str(getattr(report, "error", ""))


def test_kvfsm_test_fails_a_driver_that_frees_under_the_wrong_id() -> None:
    from buggy_drivers import FreesByTheKey

    from kvfsm.testing import run

    report = run(kvfsm.parse(SPEC, "prefill_hold.yaml"), FreesByTheKey, seed=1, examples=30)
    assert not report.passed
    assert "observe says blocks still held by req-1" in report.story[-1], _story(report)


def test_kvfsm_test_fails_the_seed_shape_naming_the_id_it_sent_and_both_spaces() -> None:
    from buggy_drivers import NotifiesWithTheKey

    from kvfsm.testing import run

    report = run(kvfsm.parse(DECODE_READ, "decode_read.yaml"), NotifiesWithTheKey, seed=1, examples=30)
    assert not report.passed
    assert report.story[-1].endswith(
        "sent read_done to prefill_hold with 'req-1', the key (space request_id); "
        "the spec says it carries remote_request_id, linked to 'p-1'"
    ), _story(report)


def test_kvfsm_test_fails_a_driver_that_sends_the_id_of_a_retired_generation() -> None:
    from buggy_drivers import NotifiesWithTheFirstId

    from kvfsm.testing import run

    report = run(kvfsm.parse(DECODE_READ, "decode_read.yaml"), NotifiesWithTheFirstId, seed=1, examples=60)
    assert not report.passed
    assert "an id no live instance has in any space; the spec says it carries remote_request_id" in report.story[-1]


def test_the_outbox_records_a_misaddressed_message_as_an_anomaly_the_journal_keeps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvfsm.replay import check_log

    spec = kvfsm.parse(DECODE_READ, "decode_read.yaml")
    path = tmp_path / "decode.jsonl"
    journal = JsonlJournal(path, machine="decode_read")
    driver = Notifier()
    t = Tracker(spec, driver, observer=journal, on_anomaly=journal.anomaly)
    driver.outbox.bind(t)
    driver.before_begin("d-1", frozenset())
    t.begin("d-1", remote_request_id="p-1")
    assert driver.outbox.sent("d-1", "read_done", "p-1")
    assert not driver.outbox.sent("d-1", "read_done", "d-1")
    [found] = driver.outbox.misaddressed()
    assert (found.sent, found.carries, found.expected) == ("d-1", "remote_request_id", "p-1")
    assert driver.outbox.counts == {"sent": 2, "misaddressed": 1}
    assert t.counts["misaddressed"] == 1 and [a.kind for a in t.anomalies()] == ["misaddressed"]
    t.fire("d-1", "abort")
    journal.close()
    report = check_log(spec, path, limits={"misaddressed": kvfsm.replay.Limit.parse("0")})
    assert not report.conforms and report.anomalies == {"misaddressed": 1}


def test_the_outbox_refuses_an_undeclared_message_and_a_tracker_of_another_machine() -> None:
    from kvfsm.engine.outbox import Outbox

    outbox = Outbox(kvfsm.parse(DECODE_READ, "decode_read.yaml"))
    assert outbox.sent("d-1", "read_done", "anything")  # unbound: counted, nothing to check against
    with pytest.raises(kvfsm.KvfsmError, match=r"declares no outgoing message .notify.*read_done"):
        outbox.sent("d-1", "notify", "p-1")
    with pytest.raises(kvfsm.KvfsmError, match="cannot check sends against a tracker of 'prefill_hold'"):
        outbox.bind(tracker()[0])


class OneIdForAll(HeldBlocks):
    """Tells the tracker the same peer id for every request: the second live one cannot be linked."""

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> dict[str, str]:
        super().before_begin(key, resources)
        return {"remote_request_id": "p-1"}


def test_the_model_predicts_a_link_refused_because_the_id_names_another_live_instance() -> None:
    from kvfsm.testing import run
    from kvfsm.testing.machine import spec_machine
    from kvfsm.testing.runner import play

    report = run(kvfsm.parse(SPEC, "prefill_hold.yaml"), OneIdForAll, seed=2, examples=20)
    assert report.passed, "\n".join(report.story) or report.error
    assert report.coverage.faults["<link remote_request_id>"] > 0  # each one held to the Tracker's ActionError
    machine = spec_machine(kvfsm.parse(SPEC, "prefill_hold.yaml"), OneIdForAll)
    m = machine()
    m.begin("req-1")
    m.begin("req-2")
    assert m.story[-1] == "t=0.0 begin req-2 → held; its remote_request_id names another live instance (not linked)"
    assert play(machine, [("begin", ("req-1",)), ("begin", ("req-2",))]) is None


def test_the_model_reads_late_stale_and_unknown_as_the_tracker_records_them() -> None:
    from kvfsm.testing.oracle import SpecModel

    spec = kvfsm.parse(SPEC, "prefill_hold.yaml")
    model = SpecModel(spec)
    t, blocks = tracker()
    script: list[tuple[str, tuple[str, ...]]] = [
        ("begin", ("p-1", "r-1")),
        ("finish", ("p-1",)),  # abort: final, not drained: r-1 still names it
        ("begin", ("p-1", "r-2")),  # a new generation: r-1 names the old one now
        ("deliver", ("r-1",)),  # stale
        ("deliver", ("p-1",)),  # the key, where a remote_request_id belongs: unknown
        ("drain", ()),  # the old generation retires: r-1 is late from now on
        ("deliver", ("r-1",)),  # late
        ("deliver", ("r-2",)),  # the live generation: applied
        ("drain", ()),
        ("deliver", ("r-2",)),  # late
        ("deliver", ("r-9",)),  # unknown
    ]
    for step, args in script:
        if step == "begin":
            blocks.held.add(args[0])
            model.begin(args[0], {"remote_request_id": args[1]})
            t.begin(args[0], remote_request_id=args[1])
        elif step == "finish":
            model.fire(args[0], "abort")
            t.fire(args[0], "abort")
        elif step == "drain":
            model.drain()
            t.finished()
        else:
            assert model.deliver("read_done", args[0]).state == t.deliver("read_done", args[0])
        assert model.ids("p-1") == t.ids("p-1")
    kinds = [(a.kind, a.id) for a in t.anomalies()]
    assert kinds == [(kind, ident) for kind, _space, ident, _event in model.anomalies]
    assert kinds == [("stale", "r-1"), ("unknown", "p-1"), ("late", "r-1"), ("late", "r-2"), ("unknown", "r-9")]


def test_a_driver_whose_outbox_is_of_another_machine_is_refused_before_any_example() -> None:
    from kvfsm.testing import run

    with pytest.raises(kvfsm.BindingError, match="outbox checks messages of machine 'decode_read', not 'renamed'"):
        run(kvfsm.parse(DECODE_READ.replace("machine: decode_read", "machine: renamed"), "r.yaml"), Notifier)
