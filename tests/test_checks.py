"""The static checks KVF101–KVF115, and the loader's KVF001 on whole files.

Each spec under ``tests/specs/broken/`` marks every line a finding must point
at with a YAML comment ``# expect: KVFnnn``; the test reads those markers, so
the code AND the line of every finding are pinned, and nothing else may be
found. Specs under ``tests/specs/clean/`` (and the canonical spec) must yield
no finding at all.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvfsm.spec as spec_api
from kvfsm.spec import Finding, SpecError, read_text, run_checks

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BROKEN = sorted((HERE / "specs" / "broken").glob("*.yaml"))
CLEAN = [*sorted((HERE / "specs" / "clean").glob("*.yaml")), ROOT / "specs" / "kv_request.yaml"]
CODES = {"KVF001", *(f"KVF1{n:02d}" for n in range(1, 16))}
WARNINGS = {"KVF102"}

MARKER = re.compile(r"#\s*expect:\s*(KVF\d{3}(?:\s*,\s*KVF\d{3})*)")
STR_FORMAT = re.compile(r"^(?P<path>.+):(?P<line>\d+): (?P<message>.+) \((?P<code>KVF\d{3})\)\. (?P<fix>.+)$", re.S)


def _marked(text: str) -> set[tuple[str, int]]:
    """The (code, line) pairs a spec text marks with ``# expect: KVFnnn[, KVFnnn]``."""
    out: set[tuple[str, int]] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        match = MARKER.search(line)
        if match:
            out.update((code.strip(), number) for code in match[1].split(","))
    return out


def _found(findings: list[Finding]) -> set[tuple[str, int]]:
    return {(f.code, f.line) for f in findings}


def _checked(text: str) -> list[Finding]:
    return run_checks(read_text(text, "inline.yaml"))


# -- the spec collections --------------------------------------------------------


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_spec_yields_exactly_the_marked_findings(path: Path) -> None:
    expected = _marked(path.read_text(encoding="utf-8"))
    assert expected, f"{path.name} marks no '# expect: KVFnnn' line"
    findings = spec_api.check(path)
    assert _found(findings) == expected, "\n".join(str(f) for f in findings)


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_spec_findings_name_the_file_and_give_a_fix(path: Path) -> None:
    for f in spec_api.check(path):
        match = STR_FORMAT.match(str(f))
        assert match is not None, str(f)
        assert match["path"] == str(path)
        assert f.fix, f"{f.code} at line {f.line} says what is wrong but not how to mend it"
        assert f.severity == ("warning" if f.code in WARNINGS else "error")


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_load_refuses_a_spec_with_error_findings_and_reports_only_errors(path: Path) -> None:
    errors = [f for f in spec_api.check(path) if f.severity == "error"]
    if not errors:  # a warning alone does not stop a spec from loading
        spec_api.load(path)
        return
    with pytest.raises(SpecError) as info:
        spec_api.load(path)
    assert list(info.value.findings) == errors


def test_every_finding_code_has_a_broken_spec() -> None:
    covered = {code for path in BROKEN for code, _ in _marked(path.read_text(encoding="utf-8"))}
    assert covered == CODES


@pytest.mark.parametrize("path", CLEAN, ids=lambda p: p.stem)
def test_clean_spec_has_no_findings(path: Path) -> None:
    assert spec_api.check(path) == []
    spec_api.load(path)


def test_findings_come_in_file_order() -> None:
    for path in BROKEN:
        findings = spec_api.check(path)
        assert [(f.line, f.col) for f in findings] == sorted((f.line, f.col) for f in findings)


# -- messages name what is wrong and how to mend it ------------------------------


def _one(path_stem: str, code: str) -> Finding:
    findings = [f for f in spec_api.check(HERE / "specs" / "broken" / f"{path_stem}.yaml") if f.code == code]
    assert len(findings) == 1, [str(f) for f in findings]
    return findings[0]


def test_kvf101_second_initial_names_both_states() -> None:
    f = _one("kvf101_two_initial", "KVF101")
    assert "'sending'" in f.message and "'pinned'" in f.message
    assert "exactly one state" in f.fix


def test_kvf103_names_the_state_and_what_it_never_releases() -> None:
    findings = spec_api.check(HERE / "specs" / "broken" / "kvf103_cycle_no_exit.yaml")
    assert [f.message for f in findings] == [
        "no final state can be reached from state 'aborting': a request there never finishes and never releases blocks",
        "no final state can be reached from state 'flushing': a request there never finishes and never releases blocks",
    ]
    assert all("leads to a final state" in f.fix for f in findings)


def test_kvf105_names_the_event_the_state_both_targets_and_the_first_line() -> None:
    f = _one("kvf105_wildcard_overlap", "KVF105")
    assert f.message == "event 'abort' in state 'sending' goes to 'aborted' here but to 'failed' at line 16"
    assert "'*'" in f.fix


def test_kvf106_timeout_fire_that_is_only_ignored_says_so() -> None:
    f = _one("kvf106_timeout_fire_only_ignored", "KVF106")
    assert "'sending'" in f.message and "'expire'" in f.message
    assert "only ignores" in f.message
    assert "{event: expire, from: sending, to: <state>}" in f.fix


def test_kvf106_undeclared_state_lists_the_declared_ones() -> None:
    findings = spec_api.check(HERE / "specs" / "broken" / "kvf106_undeclared_states.yaml")
    assert [f.message for f in findings] == [
        "transition 'complete' starts from undeclared state 'sendng'",
        "transition 'retry' goes to undeclared state 'resending'",
    ]
    assert all(f.fix.endswith("use one of: sending, done, failed.") for f in findings)


def test_kvf107_names_the_state_and_how_to_give_it_a_deadline() -> None:
    f = _one("kvf107_no_deadline", "KVF107")
    assert f.message.startswith("state 'sending' has no timeout")
    assert f.message.endswith("holding blocks")
    assert "timeout: {after:" in f.fix and "waits: local" in f.fix


def test_kvf108_fix_names_the_state_to_add() -> None:
    f = _one("kvf108_no_abort", "KVF108")
    assert (
        f.message == "state 'sending' does not accept 'abort': a request aborted there keeps running and keeps blocks"
    )
    assert f.fix.startswith("Add 'sending' to the 'from' of the abort transition")


def test_kvf109_names_the_action_event_state_and_on_error_event() -> None:
    f = _one("kvf109_acquire_without_handler", "KVF109")
    assert f.message == (
        "action 'enqueue_job' on 'enqueue' from 'pinned' can raise, but 'pinned' does not accept the on_error event 'fail'"
    )
    assert f.fix == "Add 'pinned' to the 'from' of the 'fail' transition."


def test_kvf109_on_error_with_its_own_action_names_that_action() -> None:
    findings = spec_api.check(HERE / "specs" / "broken" / "kvf109_on_error_has_do.yaml")
    assert {f.code for f in findings} == {"KVF109"}
    assert all("runs 'report_failure'" in f.message for f in findings)
    assert {f.message.split("from ")[1].split(" ")[0] for f in findings} == {"'pinned'", "'sending'"}


def test_kvf111_transition_from_final_says_how_to_accept_late_events() -> None:
    f = _one("kvf111_transition_from_final", "KVF111")
    assert "'failed'" in f.message and "'retry'" in f.message
    assert "'ignore' rule" in f.fix


# -- the checks are proofs over the graph, not pattern matches ----------------------

TRAP = """\
kvfsm: 1
machine: trap
key: request_id
states:
  start:  {{initial: true, waits: local}}
{chain}
  loop_a: {{waits: local}}                        # expect: KVF103
  loop_b: {{timeout: {{after: 1, fire: spin}}}}       # expect: KVF103
  done:   {{final: success}}
transitions:
  - {{event: finish, from: start, to: done}}
  - {{event: enter,  from: start, to: c0}}
{links}
  - {{event: spin,   from: loop_a, to: loop_b}}
  - {{event: spin,   from: loop_b, to: loop_a}}
  - {{event: abort,  from: "*", to: loop_a}}
{exit}"""


def _trap(length: int, exit_edge: bool) -> str:
    """start -> c0 -> ... -> c{length-1} -> loop_a <-> loop_b; abort from anywhere into loop_a."""
    chain = "\n".join(f"  c{i}: {{waits: local}}   # expect: KVF103" for i in range(length))
    links = "\n".join(f"  - {{event: next, from: c{i}, to: c{i + 1}}}" for i in range(length - 1))
    links += f"\n  - {{event: next, from: c{length - 1}, to: loop_a}}"
    exit_line = "  - {event: leave, from: loop_b, to: done}\n" if exit_edge else ""
    return TRAP.format(chain=chain, links=links, exit=exit_line)


@pytest.mark.parametrize("length", [1, 4, 25])
def test_kvf103_finds_every_state_that_can_only_reach_a_cycle_with_no_exit(length: int) -> None:
    # Every c_i has a way out and accepts abort; only a search of the whole graph shows
    # that every way out ends in loop_a <-> loop_b, which never reaches 'done'.
    text = _trap(length, exit_edge=False)
    findings = _checked(text)
    assert _found(findings) == _marked(text)
    assert len(findings) == length + 2


@pytest.mark.parametrize("length", [1, 4, 25])
def test_one_exit_at_the_far_end_of_the_cycle_clears_every_kvf103(length: int) -> None:
    text = _trap(length, exit_edge=True)
    assert [f for f in _checked(text) if f.code == "KVF103"] == []
    assert _checked(text) == []


def test_abort_into_a_non_final_state_that_times_out_to_a_final_is_fine() -> None:
    # abort does not go to a final state directly; the graph still reaches one through
    # the timeout of 'draining'. KVF103 must not require "abort leads to a final state".
    text = """\
kvfsm: 1
machine: drain_on_abort
key: request_id
states:
  sending:  {initial: true, timeout: {after: 5, fire: expire}}
  draining: {timeout: {after: 1, fire: expire}}
  done:     {final: success}
  failed:   {final: failure}
transitions:
  - {event: complete, from: sending,  to: done}
  - {event: expire,   from: [sending, draining], to: failed}
  - {event: abort,    from: "*",      to: draining}
"""
    assert _checked(text) == []
    # Take away the only exit of 'draining' (its timeout's event now loops) and both states are trapped.
    trapped = text.replace(
        "from: [sending, draining], to: failed}",
        "from: sending, to: failed}\n  - {event: expire, from: draining, to: draining}",
    )
    assert {(f.code, f.message.split("'")[1]) for f in _checked(trapped)} == {("KVF103", "draining")}


def test_kvf102_unreachability_is_transitive() -> None:
    # 'b' has an incoming transition, but only from 'a', which nothing reaches.
    text = """\
kvfsm: 1
machine: islands
key: request_id
states:
  start: {initial: true, waits: local}
  a:     {waits: local}                 # expect: KVF102
  b:     {waits: local}                 # expect: KVF102
  done:  {final: success}
transitions:
  - {event: finish, from: [start, b], to: done}
  - {event: go,     from: a, to: b}
  - {event: abort,  from: "*", to: done}
"""
    findings = _checked(text)
    assert _found(findings) == _marked(text)
    assert all(f.severity == "warning" for f in findings)


def test_state_reached_only_through_a_wildcard_is_reachable() -> None:
    text = """\
kvfsm: 1
machine: via_wildcard
key: request_id
states:
  start:   {initial: true, waits: local}
  cleanup: {timeout: {after: 1, fire: finish}}
  done:    {final: success}
transitions:
  - {event: finish, from: [start, cleanup], to: done}
  - {event: abort,  from: "*", to: cleanup}
"""
    assert _checked(text) == []


HOP = """\
kvfsm: 1
machine: hop
key: request_id
resources:
  slot: {{acquire: take_slot, release: give_slot}}
states:
  a:      {{initial: true, holds: [{a_holds}], waits: local}}
  b:      {{holds: [slot], waits: local}}
  done:   {{final: success}}
  failed: {{final: failure}}
transitions:
  - {{event: hop,    from: a, to: b}}
  - {{event: finish, from: b, to: done}}
  - {{event: fail,   from: b, to: failed}}
  - {{event: abort,  from: "*", to: failed}}
on_error: fail
"""


def test_kvf109_follows_acquires_only_where_the_resource_is_newly_taken() -> None:
    # a -> b keeps 'slot' when a holds it: nothing runs on 'hop', so 'a' needs no 'fail'.
    assert _checked(HOP.format(a_holds="slot")) == []
    # a -> b takes 'slot' when a does not: take_slot can raise on 'hop', and 'a' has no 'fail'.
    text = HOP.format(a_holds="")
    findings = _checked(text)
    assert [(f.code, f.line) for f in findings] == [
        ("KVF109", text.splitlines().index("  - {event: hop,    from: a, to: b}") + 1)
    ]
    assert "'take_slot'" in findings[0].message


def test_kvf109_without_on_error_reports_a_wildcard_action_once() -> None:
    text = """\
kvfsm: 1
machine: wildcard_cancel
key: request_id
states:
  a:      {initial: true, waits: local}
  b:      {waits: local}
  c:      {waits: local}
  done:   {final: success}
transitions:
  - {event: go,     from: a, to: b}
  - {event: go,     from: b, to: c}
  - {event: finish, from: c, to: done}
  - {event: abort,  from: "*", to: done, do: cancel}   # expect: KVF109
"""
    findings = _checked(text)
    assert [(f.code, f.line) for f in findings] == sorted(_marked(text))
    assert "no 'on_error' event" in findings[0].message


def test_acquire_at_begin_needs_no_on_error_handler() -> None:
    # A failing acquire at begin() creates no instance, so there is no state to handle it from.
    text = """\
kvfsm: 1
machine: begin_acquires
key: request_id
resources:
  blocks: {acquire: pin_blocks, release: free_blocks}
states:
  pinned: {initial: true, holds: [blocks], waits: local}
  done:   {final: success}
transitions:
  - {event: finish, from: pinned, to: done}
  - {event: abort,  from: "*",    to: done}
"""
    assert _checked(text) == []


def test_on_error_that_is_only_ignored_in_a_risky_state_does_not_handle_it() -> None:
    text = """\
kvfsm: 1
machine: ignored_fail
key: request_id
states:
  a:      {initial: true, waits: local}
  b:      {waits: local}
  done:   {final: success}
  failed: {final: failure}
transitions:
  - {event: go,     from: a, to: b, do: start}   # expect: KVF109
  - {event: finish, from: b, to: done}
  - {event: fail,   from: b, to: failed}
  - {event: abort,  from: "*", to: failed}
ignore:
  - {event: [fail], in: [a]}
on_error: fail
"""
    assert _found(_checked(text)) == _marked(text)


def test_kvf111_final_state_timeout_is_not_also_reported_as_kvf106() -> None:
    # One mistake, one finding: the final state's timeout fires an event it cannot accept,
    # but the fix is to remove the timeout (KVF111), not to add a transition (KVF106).
    findings = spec_api.check(HERE / "specs" / "broken" / "kvf111_final_timeout.yaml")
    assert [f.code for f in findings] == ["KVF111"]


_OUTGOING = """
kvfsm: 1
machine: decode_notify
key: request_id
spaces:
  remote_request_id: {linked_at: begin}
begin: {payload: [remote_request_id]}
outgoing:
  read: {to: nixl_prefill, carries: CARRIES}
states:
  loading: {initial: true, waits: local}
  done:    {final: success}
  aborted: {final: failure}
transitions:
  - {event: finish, from: loading, to: done}
  - {event: abort,  from: "*",     to: aborted}
"""


@pytest.mark.parametrize("carries", ["remote_request_id", "request_id"])
def test_an_outgoing_message_may_carry_the_key_or_a_declared_space(carries: str) -> None:
    assert _checked(_OUTGOING.replace("CARRIES", carries)) == []


def test_kvf106_an_outgoing_message_carrying_an_undeclared_space_names_the_declared_ones() -> None:
    [finding] = _checked(_OUTGOING.replace("CARRIES", "prefill_request_id"))
    assert (finding.code, finding.line) == ("KVF106", 9)
    assert "outgoing message 'read' carries an id from undeclared id space 'prefill_request_id'" in finding.message
    assert "request_id, remote_request_id" in finding.fix


def test_an_outgoing_message_without_carries_is_a_schema_error_that_says_what_to_write() -> None:
    with pytest.raises(SpecError) as caught:
        read_text(_OUTGOING.replace(", carries: CARRIES", ""), "inline.yaml")
    assert "outgoing message 'read'" in str(caught.value) and "carries" in str(caught.value)
