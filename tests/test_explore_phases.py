"""Phases and counts of 0 on entry in the explorer, its trace check and the Promela export.

A phase's deadline is armed on entering the phase, kept while the instance
moves inside it (a self-loop too), disarmed on leaving it; the explorer lets
it fire in any of the phase's states, orders it by the system's relations as
it orders a state's timeout, and (liveness) knows an instance cannot stay in
a phase forever. A counted transition whose K is 0 on entry fires in the move
that enters its state. SPIN must agree on all of it.

Relations are added to the loaded system here (:func:`related`), so that one
composition serves every ordering; a system file may name a phase's
``after`` in its ``relations:`` too (KVF213 reads phases).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from test_promela import agree, agree_on_liveness, needs_spin

from kvfsm.explore import ExploreError, TraceError, check_trace, explore
from kvfsm.explore.local import RETIRED, LocalSystem, Move
from kvfsm.explore.trace import Step, Trace, TraceRole
from kvfsm.spec.system import System, load_system
from kvfsm.spec.system.model import TimeRelation
from kvfsm.testing import replay_trace

PREFILL = """\
kvfsm: 1
machine: lease_prefill
key: request_id
doc: Holds the blocks under one lease, however many retries; a pause leaves the lease, resuming starts a new one.
params: {lease_ttl: 10.0, retry_after: 1.0}
resources:
  blocks: {release: free_blocks}
phases:
  lease:
    states: [serving, retrying]
    timeout: {after: lease_ttl, fire: expire}
states:
  serving:  {initial: true, holds: [blocks], waits: local}
  retrying: {holds: [blocks], timeout: {after: retry_after, fire: retry}}
  paused:   {holds: [blocks], waits: local}
  done:     {final: success}
  expired:  {final: failure}
  aborted:  {final: failure}
transitions:
  - {event: nack,   from: [serving, retrying], to: retrying}
  - {event: retry,  from: retrying, to: serving}
  - {event: pause,  from: retrying, to: paused}
  - {event: resume, from: paused, to: serving}
  - {event: read,   from: [serving, retrying, paused], to: done}
  - {event: expire, from: [serving, retrying], to: expired}
  - {event: abort,  from: "*", to: aborted}
ignore:
  - {event: [read, abort], in: [done, expired, aborted]}
"""

DECODE = """\
kvfsm: 1
machine: lease_decode
key: request_id
params: {read_timeout: 5.0}
states:
  reading: {initial: true, timeout: {after: read_timeout, fire: give_up}}
  done:    {final: success}
  failed:  {final: failure}
transitions:
  - {event: finish,  from: reading, to: done, send: {to: prefill, message: read}}
  - {event: give_up, from: reading, to: failed}
  - {event: abort,   from: "*", to: failed}
ignore:
  - {event: abort, in: [done, failed]}
"""

LATE = {  # decode starts reading after begin: its deadline is armed after the lease
    "  reading: {initial: true, ": "  waiting: {initial: true, waits: local}\n  reading: {",
    "transitions:\n": "transitions:\n  - {event: start,   from: waiting, to: reading}\n",
}

SYSTEM = """\
kvfsm: 1
system: lease
roles:
  prefill: {spec: prefill.yaml}
  decode: {spec: decode.yaml}
messages:
  read: {from: decode, to: prefill}
channel: {loss: true, duplicate: true, reorder: true, capacity: 2}
requests: 2
properties:
  never:
    - {name: read_after_free, when: {decode: reading, prefill: expired}}
"""

NO_PAUSE = {
    "  paused:   {holds: [blocks], waits: local}\n": "",
    "  - {event: pause,  from: retrying, to: paused}\n": "",
    "  - {event: resume, from: paused, to: serving}\n": "",
    "from: [serving, retrying, paused], to: done": "from: [serving, retrying], to: done",
}
LIVE = {"requests: 2\n": "requests: 1\n", "properties:\n": "properties:\n  eventually: [final, released]\n"}


def write(
    folder: Path,
    *,
    prefill: dict[str, str] | None = None,
    decode: dict[str, str] | None = None,
    system: dict[str, str] | None = None,
) -> Path:
    """The lease composition in ``folder``, each file with its edits (old → new, each must match)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text, edits in (
        ("prefill.yaml", PREFILL, prefill),
        ("decode.yaml", DECODE, decode),
        ("lease.yaml", SYSTEM, system),
    ):
        for old, new in (edits or {}).items():
            assert old in text, old
            text = text.replace(old, new)
        (folder / name).write_text(text)
    return folder / "lease.yaml"


def related(system: System, *relations: str) -> System:
    """``system`` with relations ``role.param > role.param`` added to its model, as a ``relations:`` line would."""
    out = []
    for text in relations:
        longer, shorter = (side.strip().split(".") for side in text.split(">"))
        out.append(TimeRelation((longer[0], longer[1]), ((shorter[0], shorter[1]),), text))
    return replace(system, relations=(*system.relations, *out))


def timeouts(local: LocalSystem, i: int, role: int) -> set[str]:
    """The timeout events ``role`` may fire in local state ``i``."""
    moves = [m for _j, m in local.moves[i]] + list(local.loops[i])
    return {m.event for m in moves if m.role == role and m.cause == "timeout"}


def walk(local: LocalSystem, *moves: tuple[str, str]) -> int:
    """The local state after the (role, event) moves from the start, each taken with its sends kept."""
    names = [role.name for role in local.roles]
    i = local.initial
    for role, event in moves:
        taken = [
            (j, m)
            for j, m in [*local.moves[i], *((i, m) for m in local.loops[i])]
            if names[m.role] == role and m.event == event and all(k for _x, k in m.sent) and not m.duplicate
        ]
        assert taken, f"{role} cannot {event} in {local.states[i]}"
        i = taken[0][0]
    return i


def state_of(local: LocalSystem, i: int, role: str) -> str | None:
    return local.role_state(i, [r.name for r in local.roles].index(role))


def trace(system: System, *moves: tuple[str, str, str, str, str]) -> Trace:
    """A trace of request r0: both instances begin, then (role, cause, event, from, to) moves, sending nothing."""
    begins = [
        Step("r0", name, "begin", "begin", None, None, role.spec.initial.name, holds=role.spec.initial.holds)
        for name, role in system.roles.items()
    ]
    steps = [
        Step("r0", role, "fire", cause, event, source, target, holds=system.roles[role].spec.states[target].holds)
        for role, cause, event, source, target in moves
    ]
    roles = tuple(TraceRole(n, r.path, r.spec.name, r.spec.key) for n, r in system.roles.items())
    return Trace(system.name, system.path, "read_after_free", "", "r0", roles, (*begins, *steps))


# -- (a) a phase's timeout fires from every state of the phase, and only there ------------------------------------


def test_a_phase_timeout_fires_in_every_phase_state_and_nowhere_else(tmp_path: Path) -> None:
    system = load_system(write(tmp_path))
    local = LocalSystem(system)
    prefill = 0
    seen = set()
    for i, state in enumerate(local.states):
        if state == RETIRED:
            continue
        where = state_of(local, i, "prefill")
        seen.add(where)
        assert ("expire" in timeouts(local, i, prefill)) == (where in ("serving", "retrying")), where
    assert {"serving", "retrying", "paused", "done", "expired"} <= seen
    # the lease's own states, the self-loop included: a timeout step there checks; outside the phase it does not
    check_trace(
        trace(
            system,
            ("prefill", "local", "nack", "serving", "retrying"),
            ("prefill", "local", "nack", "retrying", "retrying"),
            ("prefill", "timeout", "expire", "retrying", "expired"),
        ),
        system,
    )
    check_trace(trace(system, ("prefill", "timeout", "expire", "serving", "expired")), system)
    with pytest.raises(
        TraceError, match="a timeout step in 'paused' fires 'expire', but that state has no timeout and is in no phase"
    ):
        check_trace(
            trace(
                system,
                ("prefill", "local", "nack", "serving", "retrying"),
                ("prefill", "local", "pause", "retrying", "paused"),
                ("prefill", "timeout", "expire", "paused", "expired"),
            ),
            system,
        )
    with pytest.raises(
        TraceError, match=r"a timeout step in 'serving' fires 'retry', but that state's deadlines .* fire 'expire'"
    ):
        check_trace(trace(system, ("prefill", "timeout", "retry", "serving", "serving")), system)


def test_a_move_inside_the_phase_keeps_its_deadline_and_only_reentry_rearms_it(tmp_path: Path) -> None:
    """Decode's read deadline, armed after the lease and declared longer, waits for the lease while the prefill
    stays in the lease, whatever it does there (a self-loop included); a pause and resume starts a new lease,
    armed after the read deadline, which then no longer waits for it."""
    system = related(load_system(write(tmp_path, decode=LATE)), "decode.read_timeout > prefill.lease_ttl")
    local = LocalSystem(system)
    decode = 1
    for inside in ([], [("prefill", "nack")], [("prefill", "nack"), ("prefill", "nack"), ("prefill", "retry")]):
        i = walk(local, ("decode", "start"), *inside)
        assert state_of(local, i, "decode") == "reading"
        assert "give_up" not in timeouts(local, i, decode), inside
    again = walk(local, ("decode", "start"), ("prefill", "nack"), ("prefill", "pause"), ("prefill", "resume"))
    assert state_of(local, again, "prefill") == "serving"
    assert "give_up" in timeouts(local, again, decode)
    started_late = walk(local, ("prefill", "nack"), ("prefill", "pause"), ("prefill", "resume"), ("decode", "start"))
    assert "give_up" not in timeouts(local, started_late, decode)  # the new lease was armed first
    moves = [
        ("decode", "local", "start", "waiting", "reading"),
        ("prefill", "local", "nack", "serving", "retrying"),
        ("prefill", "local", "nack", "retrying", "retrying"),
    ]
    with pytest.raises(TraceError, match="decode's timeout cannot fire yet"):
        check_trace(trace(system, *moves, ("decode", "timeout", "give_up", "reading", "failed")), system)
    check_trace(
        trace(
            system,
            *moves,
            ("prefill", "local", "pause", "retrying", "paused"),
            ("prefill", "local", "resume", "paused", "serving"),
            ("decode", "timeout", "give_up", "reading", "failed"),
        ),
        system,
    )


# -- (b) relations order a phase's deadline like a state's ---------------------------------------------------------


def test_a_lease_declared_longer_than_the_read_never_expires_under_it(tmp_path: Path) -> None:
    plain = load_system(write(tmp_path))
    (broken,) = explore(plain).violated
    assert broken.name == "read_after_free" and broken.trace is not None
    assert [(s.role, s.cause, s.event) for s in broken.trace.moves] == [("prefill", "timeout", "expire")]
    assert replay_trace(plain, broken.trace).reproduced  # the Tracker's lease deadline, polled when due
    timed = related(plain, "prefill.lease_ttl > decode.read_timeout")
    assert explore(timed).verdict == "verified"
    with pytest.raises(TraceError, match="prefill's timeout cannot fire yet"):
        check_trace(broken.trace, timed)
    # retrying inside the lease does not restart it: still armed with the read deadline, still after it
    local = LocalSystem(timed)
    inside = walk(local, ("prefill", "nack"), ("prefill", "nack"), ("prefill", "retry"))
    assert "expire" not in timeouts(local, inside, 0)
    assert "expire" in timeouts(local, walk(local, ("decode", "finish")), 0)


def armed_slots(system: System, role: str, state: str) -> dict[str, tuple[str, str]]:
    """The deadlines armed in ``state``: ``""`` for the state's own, else the phase's name → (param, event)."""
    spec = system.roles[role].spec
    out = {}
    st = spec.states.get(state)
    if st is not None and st.timeout is not None:
        out[""] = (str(st.timeout.after), st.timeout.fire)
    for name in spec.phases_of(state):
        t = spec.phases[name].timeout
        out[name] = (str(t.after), t.fire)
    return out


@pytest.mark.parametrize(
    ("decode", "relations"),
    [
        pytest.param(None, ("prefill.lease_ttl > decode.read_timeout",), id="lease-outlasts-read"),
        pytest.param(LATE, ("decode.read_timeout > prefill.lease_ttl",), id="read-armed-later-outlasts-lease"),
        pytest.param(
            None,
            ("prefill.lease_ttl > decode.read_timeout", "prefill.lease_ttl > prefill.retry_after"),
            id="same-role",
        ),
    ],
)
def test_every_timed_run_with_phases_is_one_the_explorer_explores(
    tmp_path: Path, decode: dict[str, str] | None, relations: tuple[str, ...]
) -> None:
    """Runs with real durations that keep the relations, deadlines armed as the Tracker arms them (a phase's on
    entering it, kept inside it): each deadline that falls due must be a timeout move the explorer allows."""
    system = related(load_system(write(tmp_path, decode=decode)), *relations)
    local = LocalSystem(system)
    names = [role.name for role in local.roles]
    rng = random.Random(11)
    fired = 0
    for _run in range(300):
        durations = {r: {p: rng.uniform(0.5, 20.0) for p in role.spec.params} for r, role in system.roles.items()}
        if any(
            durations[rel.longer[0]][rel.longer[1]] <= sum(durations[r][p] for r, p in rel.shorter)
            for rel in system.relations
        ):
            continue
        i, now = local.initial, 0.0
        armed = {
            (k, slot): 0.0
            for k, name in enumerate(names)
            for slot in armed_slots(system, name, str(state_of(local, i, name)))
        }
        while local.states[i] != RETIRED:
            here = {k: armed_slots(system, name, str(state_of(local, i, name))) for k, name in enumerate(names)}
            due = {(k, slot): t + durations[names[k]][here[k][slot][0]] for (k, slot), t in armed.items()}
            moves = [(j, m) for j, m in local.moves[i] if j >= 0] + [(i, m) for m in local.loops[i]]
            others = [(j, m) for j, m in moves if m.cause != "timeout"]
            first = min(due, key=due.__getitem__) if due else None
            if first is None and not others:
                break
            step = now + rng.expovariate(1 / 3)
            if first is not None and (not others or step >= due[first]):
                now = due[first]
                event = here[first[0]][first[1]][1]
                timeouts = [(j, m) for j, m in moves if m.cause == "timeout" and (m.role, m.event) == (first[0], event)]
                assert timeouts, (
                    f"{names[first[0]]}'s {first[1] or 'state'} deadline falls due first, but is not explored"
                )
                j, move = rng.choice(timeouts)
                fired += 1
            else:
                now = step
                work = [(j, m) for j, m in others if m.cause != "abort"]  # aborts end runs early: seldom
                j, move = rng.choice(work if work and rng.random() < 0.95 else others)
            if move.action == "fire":
                _rearm(system, local, armed, move, now)
            i = j
    assert fired > 100  # the runs did reach the timeouts


def _rearm(system: System, local: LocalSystem, armed: dict[tuple[int, str], float], move: Move, now: float) -> None:
    """What the Tracker does to the deadlines of the role that fired ``move``, state by state along the move."""
    role = local.roles[move.role]
    source = role.states[move.source]
    for target in (*(role.states[s] for s in move.via), role.states[move.target]):
        before, after = armed_slots(system, role.name, source), armed_slots(system, role.name, target)
        for slot in set(before) | set(after):
            if slot not in after:
                armed.pop((move.role, slot), None)
            elif slot == "" or slot not in before:
                armed[(move.role, slot)] = now  # a state's own: every entry; a phase: entering it from outside
        source = target


# -- liveness: an instance cannot stay in a phase forever -----------------------------------------------------------


def test_retrying_inside_a_lease_cannot_go_on_forever_but_pausing_out_of_it_can(tmp_path: Path) -> None:
    lease = explore(write(tmp_path / "lease", prefill=NO_PAUSE, system=LIVE))
    assert {p.name: p.status for p in lease.properties if p.kind == "eventually"} == {
        "final": "holds",
        "released": "holds",
    }
    paused = explore(write(tmp_path / "paused", system=LIVE))
    final = next(p for p in paused.properties if p.name == "final")
    assert final.status == "violated" and final.trace is not None
    cycle = {s.event for s in final.trace.cycle}
    assert {"pause", "resume"} <= cycle  # each pass leaves the lease, and re-entering starts a new one


# -- counts of 0 on entry: the counted transition fires in the move that enters the state ---------------------------

HANDOVER_PREFILL = """\
kvfsm: 1
machine: handover_prefill
key: request_id
params: {readers: 0, hold_timeout: 30.0}
resources:
  blocks: {release: free_blocks}
states:
  computing: {initial: true, holds: [blocks], waits: local}
  held:      {holds: [blocks], timeout: {after: hold_timeout, fire: expire}}
  freed:     {final: success}
  expired:   {final: failure}
  aborted:   {final: failure}
transitions:
  - {event: hand_over, from: computing, to: held, send: {to: decode, message: blocks}}
  - {event: read,      from: held, to: freed, count: readers}
  - {event: expire,    from: held, to: expired}
  - {event: abort,     from: "*", to: aborted}
ignore:
  - {event: [read, abort], in: [freed, expired, aborted]}
"""

HANDOVER_DECODE = """\
kvfsm: 1
machine: handover_decode
key: request_id
params: {wait_timeout: 5.0}
states:
  waiting: {initial: true, timeout: {after: wait_timeout, fire: give_up}}
  reading: {waits: local}
  done:    {final: success}
  failed:  {final: failure}
transitions:
  - {event: blocks,  from: waiting, to: reading}
  - {event: finish,  from: reading, to: done, send: {to: prefill, message: read}}
  - {event: give_up, from: waiting, to: failed}
  - {event: abort,   from: "*", to: failed}
ignore:
  - {event: blocks, in: [reading, done, failed]}
  - {event: abort, in: [done, failed]}
"""

HANDOVER = """\
kvfsm: 1
system: handover
roles:
  prefill: {spec: prefill.yaml}
  decode: {spec: decode.yaml}
messages:
  blocks: {from: prefill, to: decode}
  read: {from: decode, to: prefill}
channel: {loss: true, duplicate: true, reorder: true, capacity: 2}
requests: 2
properties:
  never:
    - {name: read_after_free, when: {decode: reading, prefill: freed}}
"""


def handover(folder: Path, prefill: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = HANDOVER_PREFILL
    for old, new in (prefill or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    (folder / "prefill.yaml").write_text(text)
    (folder / "decode.yaml").write_text(HANDOVER_DECODE)
    (folder / "handover.yaml").write_text(HANDOVER)
    return folder / "handover.yaml"


def test_a_count_of_zero_on_entry_fires_in_the_move_that_enters_the_state(tmp_path: Path) -> None:
    system = load_system(handover(tmp_path / "zero"))
    local = LocalSystem(system)
    assert "held" not in {state_of(local, i, "prefill") for i in range(len(local.states))}
    assert ("prefill", "held") in local.reached()  # entered, its actions run, and left in the same move
    (hand_over,) = [m for _j, m in local.moves[local.initial] if m.event == "hand_over" and all(k for _m, k in m.sent)]
    roles = local.roles[0]
    assert (roles.states[hand_over.source], roles.states[hand_over.target]) == ("computing", "freed")
    assert [roles.states[s] for s in hand_over.via] == ["held"]
    (broken,) = explore(system).violated
    assert broken.name == "read_after_free" and broken.trace is not None
    first = broken.trace.moves[0]
    assert (first.event, first.source, first.target, first.holds) == ("hand_over", "computing", "freed", ())
    assert "held waits for 0 senders: read fires at once" in first.note and "frees blocks" in first.note
    check_trace(broken.trace, system)
    result = replay_trace(system, broken.trace)  # the Tracker frees the blocks in that very call
    assert result.reproduced, result.summary
    waits = load_system(handover(tmp_path / "one", {"readers: 0": "readers: 1"}))
    assert explore(waits).verdict == "verified"


def test_an_initial_state_that_counts_to_zero_is_left_at_begin(tmp_path: Path) -> None:
    edits = {"  computing: {initial: true, ": "  computing: {", "  held:      {": "  held:      {initial: true, "}
    system = load_system(handover(tmp_path / "begin", edits))
    local = LocalSystem(system)
    assert state_of(local, local.initial, "prefill") == "freed"
    assert ("prefill", "held") in local.reached()
    sends = {**edits, "to: freed, count: readers}": "to: freed, count: readers, send: {to: decode, message: blocks}}"}
    with pytest.raises(ExploreError, match="cannot send at begin"):
        LocalSystem(load_system(handover(tmp_path / "sends", sends)))


# -- SPIN agrees ----------------------------------------------------------------------------------------------------


@needs_spin
@pytest.mark.spin
def test_spin_agrees_on_phases_relations_and_counts_of_zero(tmp_path: Path) -> None:
    """The same states and verdicts: a phase's timeout in every phase state, ordered by a relation that names it,
    kept across moves inside the phase (the late read deadline waits for it), and a count of 0 on entry."""
    timed = related(load_system(write(tmp_path / "timed")), "prefill.lease_ttl > decode.read_timeout")
    assert agree(timed, 2, tmp_path / "spin-timed") == set()
    late = related(load_system(write(tmp_path / "late", decode=LATE)), "decode.read_timeout > prefill.lease_ttl")
    assert agree(late, 2, tmp_path / "spin-late") == {"read_after_free"}
    assert agree(load_system(handover(tmp_path / "zero")), 2, tmp_path / "spin-zero") == {"read_after_free"}


@needs_spin
@pytest.mark.spin
def test_spin_agrees_that_a_lease_ends_retrying_inside_it(tmp_path: Path) -> None:
    lease = load_system(write(tmp_path / "lease", prefill=NO_PAUSE, system=LIVE))
    assert agree_on_liveness(lease, tmp_path / "spin-lease") == {"final": "holds", "released": "holds"}
    paused = load_system(write(tmp_path / "paused", system=LIVE))
    assert agree_on_liveness(paused, tmp_path / "spin-paused") == {"final": "violated", "released": "violated"}


def test_a_relation_may_name_a_phases_deadline_in_the_system_file(tmp_path: Path) -> None:
    from kvfsm.spec.system import check_system

    path = write(
        tmp_path, system={"properties:\n": "relations:\n  - prefill.lease_ttl > decode.read_timeout\nproperties:\n"}
    )
    assert [f.code for f in check_system(path) if f.severity == "error"] == []
    assert explore(load_system(path)).verdict == "verified"
    bad = write(
        tmp_path / "bad", system={"properties:\n": "relations:\n  - prefill.lease > decode.read_timeout\nproperties:\n"}
    )
    assert "KVF213" in [f.code for f in check_system(bad)]
