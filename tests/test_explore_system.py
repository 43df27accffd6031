"""Composition specs: the `send` key, the system file loader, and the composition checks KVF200–KVF212.

``write_pingpong`` builds a small client/server composition in a temporary
folder; each test changes one thing and looks for the one finding it causes.
The explorer and Promela tests use it too.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

import pytest

import kvfsm
from kvfsm.spec import SpecError, read_text
from kvfsm.spec.system import LastStep, Snapshot, check_system, is_system_file, load_system, violation

ROOT = Path(__file__).resolve().parent.parent
PD = ROOT / "specs" / "pd_abort"

CLIENT = """\
kvfsm: 1
machine: client
key: request_id
params: {reply_timeout: 5.0}
resources:
  slot: {release: free_slot}
states:
  idle:    {initial: true, waits: local}
  waiting: {holds: [slot], timeout: {after: reply_timeout, fire: expire}}
  done:    {final: success}
  failed:  {final: failure}
transitions:
  - {event: ask, from: idle, to: waiting, send: {to: server, message: ping}}
  - {event: pong, from: waiting, to: done}
  - {event: expire, from: waiting, to: failed}
  - {event: abort, from: "*", to: failed}
ignore:
  - {event: pong, in: [idle, done, failed]}
  - {event: abort, in: [done, failed]}
"""

SERVER = """\
kvfsm: 1
machine: server
key: request_id
params: {idle_timeout: 30.0}
states:
  listening: {initial: true, timeout: {after: idle_timeout, fire: expire}}
  replying:  {waits: local}
  served:    {final: success}
  gone:      {final: failure}
transitions:
  - {event: ping, from: listening, to: replying}
  - {event: answer, from: replying, to: served, send: {to: client, message: pong}}
  - {event: expire, from: listening, to: gone}
  - {event: abort, from: "*", to: gone}
ignore:
  - {event: ping, in: [replying, served, gone]}
  - {event: abort, in: [served, gone]}
"""

SYSTEM = """\
kvfsm: 1
system: pingpong
roles:
  client: {spec: client.yaml}
  server: {spec: server.yaml}
messages:
  ping: {from: client, to: server}
  pong: {from: server, to: client}
channel: {loss: true, duplicate: true, reorder: true, capacity: 2}
requests: 2
properties:
  never:
    - {name: served_but_failed, when: {client: failed, server: served}}
"""


def write_pingpong(
    folder: Path,
    *,
    client: str = CLIENT,
    server: str = SERVER,
    system: str = SYSTEM,
    edits: dict[str, str] | None = None,
) -> Path:
    """Write the composition (after replacing each ``edits`` key by its value in any file); the system's path."""
    texts = {"client.yaml": client, "server.yaml": server, "system.yaml": system}
    for old, new in (edits or {}).items():
        hits = [name for name, text in texts.items() if old in text]
        assert hits, f"{old!r} is in none of the files"
        for name in hits:
            texts[name] = texts[name].replace(old, new)
    for name, text in texts.items():
        (folder / name).write_text(text)
    return folder / "system.yaml"


def codes(findings: list[kvfsm.Finding]) -> list[tuple[str, str, str, int]]:
    return [(f.code, f.severity, Path(f.path).name, f.line) for f in findings]


# -- the `send` key on machine transitions ---------------------------------------------


def test_send_is_read_as_one_message_or_a_list_with_lines() -> None:
    spec = read_text(
        "kvfsm: 1\nmachine: m\nkey: k\nstates:\n  a: {initial: true, waits: local}\n  b: {final: success}\n"
        "transitions:\n"
        "  - {event: go, from: a, to: b, send: {to: peer, message: hello}}\n"
        "  - event: abort\n    from: a\n    to: b\n    send:\n      - {to: peer, message: bye}\n      - {to: other, message: bye}\n"
    )
    go, abort = spec.transitions
    assert [(s.to, s.message, s.loc.line) for s in go.sends] == [("peer", "hello", 8)]
    assert [(s.to, s.message, s.loc.line) for s in abort.sends] == [("peer", "bye", 13), ("other", "bye", 14)]


def test_machine_specs_without_send_have_no_sends() -> None:
    spec = kvfsm.load(ROOT / "specs" / "kv_request.yaml")
    assert all(t.sends == () for t in spec.transitions)


@pytest.mark.parametrize(
    ("send", "message"),
    [
        ("{to: peer}", "send is missing required key 'message'"),
        ("{to: peer, message: hi, via: zmq}", "send has unknown key 'via'"),
        ("[]", "send is an empty list"),
        ("{to: peer, message: 'not a name'}", "send: message 'not a name' is not a valid name"),
    ],
)
def test_malformed_send_is_a_schema_error_on_its_line(send: str, message: str) -> None:
    text = (
        "kvfsm: 1\nmachine: m\nkey: k\nstates:\n  a: {initial: true, waits: local}\n  b: {final: success}\n"
        f"transitions:\n  - {{event: go, from: a, to: b, send: {send}}}\n"
    )
    with pytest.raises(SpecError) as info:
        read_text(text, "m.yaml")
    assert [(f.code, f.line) for f in info.value.findings] == [("KVF001", 8)]
    assert message in info.value.findings[0].message


# -- the bundled PD abort systems ----------------------------------------------------------


@pytest.mark.parametrize("name", ["merged_fix", "corrected"])
def test_bundled_pd_systems_are_clean(name: str) -> None:
    assert check_system(PD / f"{name}.yaml") == []


@pytest.mark.parametrize("path", sorted(p for p in PD.glob("*.yaml") if not is_system_file(p)), ids=lambda p: p.stem)
def test_pd_role_specs_pass_the_machine_checks(path: Path) -> None:
    assert kvfsm.check(path) == []


def test_system_files_are_told_apart_from_machine_specs() -> None:
    assert is_system_file(PD / "merged_fix.yaml")
    assert not is_system_file(PD / "prefill_corrected.yaml")
    assert not is_system_file(PD / "no_such_file.yaml")


def test_loaded_system_knows_roles_messages_channel_and_properties() -> None:
    system = load_system(PD / "corrected.yaml")
    assert list(system.roles) == ["prefill", "decode"]
    assert system.roles["decode"].spec.name == "pd_decode_corrected"
    assert system.messages["abort_req"].reply_if_finished == "abort_ack"
    assert set(system.inbox("decode")) == {"abort_ack", "success", "failure"}
    c = system.channel
    assert (c.loss, c.duplicate, c.reorder, c.capacity) == (True, True, True, 2)
    assert system.requests == 6
    assert system.names == ("deadlock", "leak", "late_message", "unexpected_message", "overflow", "write_after_free")
    assert [p.kind for p in system.properties] == [*system.names[:-1], "never"]
    assert system.never[0].describe() == "prefill is in transferring or draining while decode lacks kv_pages"


# -- composition checks ---------------------------------------------------------------------


def test_pingpong_is_clean(tmp_path: Path) -> None:
    assert check_system(write_pingpong(tmp_path)) == []


@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        pytest.param(
            {"message: ping}}": "message: pings}}"},
            [("KVF201", "error", "client.yaml", 13), ("KVF204", "warning", "system.yaml", 7)],
            id="undeclared-message",
        ),
        pytest.param(
            {"{to: server, message: ping}": "{to: client, message: ping}"},
            [("KVF202", "error", "client.yaml", 13)],
            id="sent-to-the-wrong-role",
        ),
        pytest.param(
            {"ping: {from: client, to: server}": "ping: {from: server, to: server}"},
            [("KVF202", "error", "client.yaml", 13), ("KVF211", "error", "system.yaml", 7)],
            id="sent-by-a-role-it-is-not-from",
        ),
        pytest.param(
            {
                "{event: pong, from: waiting, to: done}": "{event: pong2, from: waiting, to: done}",
                "{event: pong, in: [idle, done, failed]}": "{event: pong2, in: [idle, done, failed]}",
            },
            [("KVF203", "error", "system.yaml", 8)],
            id="no-role-receives-it",
        ),
        pytest.param(
            {"waiting: {holds: [slot], timeout: {after: reply_timeout, fire: expire}}": "waiting: {holds: [slot]}"},
            [("KVF107", "error", "client.yaml", 9)],
            id="role-errors-are-reported-with-the-role-file",
        ),
        pytest.param(
            {"  - {event: pong, in: [idle, done, failed]}\n": "  - {event: pong, in: [done, failed]}\n"},
            [("KVF205", "warning", "system.yaml", 8)],
            id="neither-handled-nor-ignored-somewhere",
        ),
        pytest.param(
            {
                "listening: {initial: true, timeout: {after: idle_timeout, fire: expire}}": "listening: {initial: true, waits: local}",
                "  - {event: expire, from: listening, to: gone}\n": "",
            },
            [("KVF206", "error", "server.yaml", 6)],
            id="waits-local-but-only-a-message-moves-it",
        ),
        pytest.param(
            {"timeout: {after: idle_timeout, fire: expire}}": "timeout: {after: idle_timeout, fire: ping}}"},
            [("KVF208", "error", "server.yaml", 6)],
            id="timeout-fires-a-message",
        ),
        pytest.param(
            {"when: {client: failed, server: served}": "when: {client: failed, server: nowhere, proxy: up}"},
            [("KVF209", "error", "system.yaml", 13), ("KVF209", "error", "system.yaml", 13)],
            id="property-names-unknown-role-and-state",
        ),
        pytest.param(
            {"when: {client: failed, server: served}": "when: {client: {lacks: [slots]}}"},
            [("KVF209", "error", "system.yaml", 13)],
            id="property-names-unknown-resource",
        ),
        pytest.param(
            {"ping: {from: client, to: server}": "ping: {from: client, to: server, reply_if_finished: ping}"},
            [("KVF210", "error", "system.yaml", 7)],
            id="reply-goes-the-wrong-way",
        ),
        pytest.param(
            {
                "ping: {from: client, to: server}": "ping: {from: client, to: server}\n  abort: {from: client, to: server}"
            },
            [("KVF204", "warning", "system.yaml", 8), ("KVF212", "error", "system.yaml", 8)],
            id="message-named-abort",
        ),
        pytest.param(
            {"client: {spec: client.yaml}": "client: {spec: clients.yaml}"},
            [("KVF200", "error", "system.yaml", 4)],
            id="role-spec-missing",
        ),
    ],
)
def test_composition_finding(tmp_path: Path, edits: dict[str, str], expected: list[tuple[str, str, str, int]]) -> None:
    assert sorted(codes(check_system(write_pingpong(tmp_path, edits=edits)))) == sorted(expected)


def test_state_entered_only_on_a_message_never_sent_never_arms_its_timeout(tmp_path: Path) -> None:
    server = (
        SERVER.replace(
            "  served:    {final: success}\n",
            "  served:    {final: success}\n  retrying:  {timeout: {after: idle_timeout, fire: expire}}\n",
        )
        .replace(
            "  - {event: expire, from: listening, to: gone}\n",
            "  - {event: expire, from: [listening, retrying], to: gone}\n  - {event: nudge, from: listening, to: retrying}\n",
        )
        .replace("ignore:\n", "ignore:\n  - {event: nudge, in: [replying, served, gone, retrying]}\n")
    )
    system = SYSTEM.replace(
        "  pong: {from: server, to: client}\n",
        "  pong: {from: server, to: client}\n  nudge: {from: client, to: server}\n",
    )
    found = codes(check_system(write_pingpong(tmp_path, server=server, system=system)))
    assert ("KVF207", "warning", "server.yaml", 9) in found  # the timeout of 'retrying' is never armed
    assert ("KVF204", "warning", "system.yaml", 9) in found  # nothing sends 'nudge'


def test_message_only_ever_ignored_is_a_warning(tmp_path: Path) -> None:
    found = check_system(
        write_pingpong(
            tmp_path,
            edits={
                "  - {event: pong, from: waiting, to: done}\n": "  - {event: pong2, from: waiting, to: done}\n",
                "  - {event: pong, in: [idle, done, failed]}\n": "  - {event: pong, in: [idle, done, failed]}\n  - {event: pong2, in: [idle, done, failed]}\n",
            },
        )
    )
    kvf203 = [f for f in found if f.code == "KVF203"]
    assert [(f.severity, "only ever ignores it" in f.message) for f in kvf203] == [("warning", True)]


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"requests: 2": "requests: 0"}, "requests must be at least 1"),
        ({"capacity: 2": "capacity: two"}, "channel: capacity must be a whole number"),
        ({"reorder: true": "reorder: maybe"}, "channel: reorder must be true or false"),
        ({"requests: 2": "requests: 2\nbogus: 1"}, "the system has unknown key 'bogus'"),
        ({"- {name: served_but_failed,": "- {name: deadlock,"}, "property name 'deadlock' is used twice"),
    ],
)
def test_system_schema_errors_are_kvf001(tmp_path: Path, edits: dict[str, str], message: str) -> None:
    found = check_system(write_pingpong(tmp_path, edits=edits))
    assert [f.code for f in found] == ["KVF001"]
    assert message in found[0].message


def test_load_system_raises_on_errors_but_not_on_warnings(tmp_path: Path) -> None:
    warned = write_pingpong(
        tmp_path, edits={"  - {event: pong, in: [idle, done, failed]}\n": "  - {event: pong, in: [done, failed]}\n"}
    )
    assert load_system(warned).name == "pingpong"
    broken = write_pingpong(tmp_path, edits={"message: ping}}": "message: pings}}"})
    with pytest.raises(SpecError) as info:
        load_system(broken)
    assert [f.code for f in info.value.findings] == ["KVF201"]


def test_a_machine_spec_is_not_taken_for_a_system() -> None:
    found = check_system(PD / "decode_corrected.yaml")
    assert [(f.code, f.line) for f in found] == [("KVF001", 12)]
    assert "this is a machine spec" in found[0].message


def test_missing_system_file_is_a_read_error() -> None:
    found = check_system("no/such/system.yaml")
    assert [(f.code, f.line) for f in found] == [("KVF000", 0)]


@pytest.mark.parametrize(
    ("edits", "requests", "capacity"),
    [
        pytest.param({"requests: 2": "requests: 010"}, 8, 2, id="yaml-1.1-octal"),
        pytest.param({"capacity: 2": "capacity: 0x3"}, 2, 3, id="hex"),
        pytest.param({"requests: 2": "requests: 1_000"}, 1000, 2, id="underscores"),
    ],
)
def test_counts_read_every_yaml_integer_notation(
    tmp_path: Path, edits: dict[str, str], requests: int, capacity: int
) -> None:
    system = load_system(write_pingpong(tmp_path, edits=edits))
    assert (system.requests, system.channel.capacity) == (requests, capacity)


# -- the properties' one evaluator -------------------------------------------------------------

NO_ANSWER = {"  - {event: answer, from: replying, to: served, send: {to: client, message: pong}}\n": ""}


def snapshot(
    client: str | None,
    server: str | None,
    *,
    held: Mapping[str, Collection[str]] | None = None,
    in_flight: int = 0,
    load: int = 0,
    last: LastStep | None = None,
) -> Snapshot:
    return Snapshot({"client": client, "server": server}, held or {}, in_flight, load, last)


def test_a_request_nothing_can_move_is_a_deadlock_holding_nothing_and_a_leak_holding_something(
    tmp_path: Path,
) -> None:
    system = load_system(write_pingpong(tmp_path, edits=NO_ANSWER))
    deadlock, leak = system.property_named("deadlock"), system.property_named("leak")
    empty = snapshot("done", "replying")
    assert violation(system, deadlock, empty) == (
        "nothing can move server in replying and nothing is in flight (only an abort would end it)"
    )
    assert violation(system, leak, empty) is None
    holding = snapshot("done", "replying", held={"server": {"worker"}})
    assert (
        violation(system, leak, holding)
        == "nothing can move server in replying and nothing is in flight; it keeps server: worker"
    )
    assert violation(system, deadlock, holding) is None
    for moving in (snapshot("done", "replying", in_flight=1), snapshot("waiting", "replying")):
        assert violation(system, deadlock, moving) is None  # a message may still arrive; the client times out


def test_a_rejected_message_is_late_in_a_final_state_and_unexpected_in_a_live_one(tmp_path: Path) -> None:
    system = load_system(write_pingpong(tmp_path))
    late, unexpected = system.property_named("late_message"), system.property_named("unexpected_message")
    rejected = LastStep("client", "pong", rejected=True)
    done, waiting = snapshot("done", "served", last=rejected), snapshot("waiting", "served", last=rejected)
    assert violation(system, late, done) == "pong reaches client after it finished in done, which does not ignore it"
    assert violation(system, unexpected, done) is None
    assert (
        violation(system, unexpected, waiting) == "pong reaches client in waiting, which neither handles nor ignores it"
    )
    assert violation(system, late, waiting) is None
    accepted = snapshot("done", "served", last=LastStep("client", "pong"))
    assert violation(system, late, accepted) is None


def test_overflow_is_a_send_past_capacity_on_a_channel_that_may_not_lose_it(tmp_path: Path) -> None:
    reliable = {"loss: true, duplicate: true, reorder: true, capacity: 2": "loss: false, capacity: 1"}
    sent = LastStep("client", "ask", sent=("ping",))
    for edits, load, expected in [
        (reliable, 2, "client sends ping but the channel is full (capacity 1) and may not lose it"),
        (reliable, 1, None),
        ({}, 3, None),  # a lossy channel drops what does not fit
    ]:
        system = load_system(write_pingpong(tmp_path, edits=edits))
        snap = snapshot("waiting", "listening", in_flight=1, load=load, last=sent)
        assert violation(system, system.property_named("overflow"), snap) == expected


def test_a_never_property_names_the_states_it_was_met_in(tmp_path: Path) -> None:
    system = load_system(write_pingpong(tmp_path))
    prop = system.property_named("served_but_failed")
    assert prop.kind == "never" and not prop.builtin
    assert violation(system, prop, snapshot("failed", "served")) == "client is in failed while server is in served"
    assert violation(system, prop, snapshot("failed", None)) is None  # no server instance meets no condition


def test_a_rejected_shape_is_explored_only_when_asked_and_its_check_errors_come_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfsm.cli import main
    from kvfsm.spec.bundled import SPECS
    from kvfsm.spec.system import read_system

    pre_fix = SPECS / "moriio" / "write_pre_fix.yaml"
    with pytest.raises(SpecError):
        load_system(pre_fix)
    system, rejected = read_system(pre_fix)
    assert {f.code for f in rejected} == {"KVF107"} and system.roles
    assert main(["explore", str(pre_fix), "--unchecked", "--first"]) == 1  # the hang KVF107 warns of, as a trace
    shown = capsys.readouterr()
    assert "KVF107" in shown.out + shown.err and "leak" in shown.out
    with pytest.raises(SpecError):  # a composition that cannot be read is never explored
        read_system(SPECS / "moriio" / "no_such_system.yaml")


@pytest.mark.parametrize("name", ["kv_request.yaml", "moriio/write_pre_fix.yaml"], ids=["machine_spec", "pre_fix"])
def test_explore_refuses_what_it_cannot_explore_as_unusable_not_violated(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 1 means "a property is violated": a machine spec given as a system, or a composition that fails its
    checks, is unusable (2), as in check, test and replay."""
    from kvfsm.cli import main
    from kvfsm.spec.bundled import SPECS

    assert main(["explore", str(SPECS / name)]) == 2
    shown = capsys.readouterr()
    assert ("KVF001" if name == "kv_request.yaml" else "KVF107") in shown.out + shown.err
    assert ("--unchecked" in shown.err) == (name != "kv_request.yaml"), "the hint only where --unchecked would help"
