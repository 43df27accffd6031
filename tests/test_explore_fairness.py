"""The explorer's verdicts on a correct design are not false alarms: who sends a remote event, and progress fairness.

The lookup system (``tests/specs/lookup/``): a client holds a slot while it
looks its blocks up in a store, re-looks in its local cache on every step
(``relookup``, a self-loop) and gives up at its deadline; the store answers
``hit``, a remote event of the client. It is correct. Each variant next to it
is a design that is really broken, and stays reported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_promela import agree, agree_on_liveness, needs_spin

from kvfsm.explore import Trace, check_trace, describe_step, explore
from kvfsm.spec import SpecError
from kvfsm.spec.system import check_system, load_system, read_system

LOOKUP = Path(__file__).resolve().parent / "specs" / "lookup"


def live(path: Path) -> dict[str, str]:
    result = explore(path)
    return {p.name: p.status for p in result.properties if p.kind == "eventually"}


def variant(folder: Path, edits: dict[str, dict[str, str]]) -> Path:
    """A copy of the lookup folder in ``folder``, with ``edits[file]`` (old text → new) made; the folder."""
    for source in LOOKUP.glob("*.yaml"):
        text = source.read_text()
        for old, new in edits.get(source.name, {}).items():
            assert old in text, old
            text = text.replace(old, new)
        (folder / source.name).write_text(text)
    return folder


ENVIRONMENT = {"client: {spec: client.yaml}": "client: {spec: client.yaml, environment: [hit]}"}


# -- a remote event needs a sender: a message, or the environment (KVF217, KVF218) ---------------------------------


def test_a_remote_event_no_message_delivers_is_kvf217_on_the_system_file() -> None:
    path = LOOKUP / "lookup_hit_unlisted.yaml"
    (finding,) = check_system(path)
    assert (finding.code, finding.severity, Path(finding.path).name, finding.line) == (
        "KVF217",
        "error",
        "lookup_hit_unlisted.yaml",
        6,
    )
    assert "'hit' is 'remote: true'" in finding.message and "client.yaml line 24" in finding.message
    assert "'hit: {from: <sending role>, to: client}'" in finding.fix and "'environment: [hit]'" in finding.fix


def test_kvf217_names_the_sender_where_a_roles_outgoing_declaration_says_it_sends_the_event(tmp_path: Path) -> None:
    says = {"  - {event: abort, in: [served, gone]}\n": "  - {event: abort, in: [served, gone]}\n"
            "outgoing:\n  hit: {to: lookup_client, carries: request_id}\n"}  # fmt: skip
    (finding,) = check_system(variant(tmp_path, {"store_unsent.yaml": says}) / "lookup_hit_unlisted.yaml")
    assert "'hit: {from: store, to: client}'" in finding.fix


def test_the_explorer_refuses_a_remote_event_nobody_sends_instead_of_firing_it_at_any_time() -> None:
    path = LOOKUP / "lookup_hit_unlisted.yaml"
    with pytest.raises(SpecError, match="KVF217"):
        load_system(path)
    with pytest.raises(SpecError, match="KVF217"):  # --unchecked too: the composition itself is unsaid
        read_system(path)


@pytest.mark.parametrize("unchecked", [[], ["--unchecked"]], ids=["checked", "unchecked"])
def test_explore_exits_2_on_kvf217_and_does_not_suggest_unchecked(
    unchecked: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfsm.cli import main

    assert main(["explore", *unchecked, str(LOOKUP / "lookup_hit_unlisted.yaml")]) == 2
    shown = capsys.readouterr()
    assert "KVF217" in shown.err and "--unchecked" not in shown.err


def test_a_remote_event_declared_the_environments_happens_at_any_time_and_is_never_owed(tmp_path: Path) -> None:
    path = variant(tmp_path, {"lookup_hit_unlisted.yaml": ENVIRONMENT}) / "lookup_hit_unlisted.yaml"
    assert check_system(path) == []
    system = load_system(path)
    result = explore(system)
    early = next(p for p in result.properties if p.name == "hit_before_lookup")
    assert early.status == "violated" and early.trace is not None  # the user said: from outside, at any time
    step = early.trace.moves[-1]
    assert (step.cause, describe_step(step)) == ("environment", "hit (from outside the system): looking_up → found")
    check_trace(Trace.from_dict(early.trace.as_dict()), system)
    assert {p.name: p.status for p in result.properties if p.kind == "eventually"} == {
        "final": "holds",
        "released": "holds",
    }


def test_the_environment_names_events_of_the_role_that_are_no_message(tmp_path: Path) -> None:
    typo = {"client: {spec: client.yaml}": "client: {spec: client.yaml, environment: [hits]}"}
    (finding,) = check_system(variant(tmp_path, {"lookup.yaml": typo}) / "lookup.yaml")
    assert (finding.code, finding.line) == ("KVF218", 8) and finding.fix == "Did you mean 'hit'?"
    (finding,) = check_system(variant(tmp_path, {"lookup.yaml": ENVIRONMENT}) / "lookup.yaml")
    assert finding.code == "KVF218" and "it is a message from 'store'" in finding.message


# -- progress fairness: a self-loop is not taken forever while the role can leave by its own work -----------------


def test_a_retry_self_loop_with_a_way_out_is_live() -> None:
    assert explore(LOOKUP / "lookup.yaml").verdict == "verified"
    assert live(LOOKUP / "lookup.yaml") == {"final": "holds", "released": "holds"}


def test_a_retry_self_loop_with_no_way_out_is_still_a_livelock() -> None:
    result = explore(LOOKUP / "lookup_no_deadline.yaml")
    final = next(p for p in result.properties if p.name == "final")
    assert final.status == "violated" and final.trace is not None
    assert [(s.role, s.event) for s in final.trace.cycle] == [("client", "relookup")]
    assert final.trace.violation == "the request never finishes: client in looking_up forever"


BACKOFF = {
    "  found:      {final: success}\n": "  backoff:    {holds: [slot], waits: local}\n  found:      {final: success}\n",
    "  - {event: relookup, from: looking_up, to: looking_up}": "  - {event: relookup, from: looking_up, to: backoff}\n"
    "  - {event: retry, from: backoff, to: looking_up}",
    "{event: hit, in: [idle, found, missed, aborted]}": "{event: hit, in: [idle, backoff, found, missed, aborted]}",
    "[relookup, give_up, abort], in:": "[relookup, retry, give_up, abort], in:",
}
"""The retry through a second state (``looking_up → backoff → looking_up``): each pass re-enters looking_up and
re-arms its deadline, so it can really go on forever."""


def backoff(folder: Path) -> Path:
    return variant(folder, {"client.yaml": BACKOFF}) / "lookup.yaml"


def test_a_retry_through_another_state_can_go_on_forever(tmp_path: Path) -> None:
    result = explore(backoff(tmp_path))
    final = next(p for p in result.properties if p.name == "final")
    assert final.status == "violated" and final.trace is not None
    assert [(s.role, s.event) for s in final.trace.cycle] == [("client", "relookup"), ("client", "retry")]


@needs_spin
@pytest.mark.spin
def test_spin_under_the_same_fairness_agrees(tmp_path: Path) -> None:
    correct = load_system(LOOKUP / "lookup.yaml")
    assert agree(correct, 1, tmp_path / "safety") == set()
    assert agree_on_liveness(correct, tmp_path / "live") == {"final": "holds", "released": "holds"}
    broken = load_system(LOOKUP / "lookup_no_deadline.yaml")
    assert agree_on_liveness(broken, tmp_path / "stuck") == {"final": "violated", "released": "violated"}
    looped = load_system(backoff(tmp_path))
    assert agree_on_liveness(looped, tmp_path / "backoff") == {"final": "violated", "released": "violated"}
