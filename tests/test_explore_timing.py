"""Timeout relations: which deadline outlasts which, read from the system file and honoured by the explorer.

SPIN's agreement on the bundled timed compositions is in test_promela.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_explore_system import write_pingpong

from kvfsm.explore import TraceError, check_trace, explore
from kvfsm.explore.local import LocalSystem
from kvfsm.spec import SpecError
from kvfsm.spec.system import System, check_system, load_system
from kvfsm.spec.system.model import TimeRelation, Timing

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "specs" / "explore"


def status(system: System | Path, name: str) -> str:
    return next(p.status for p in explore(system).properties if p.name == name)


def without_relations(folder: Path) -> Path:
    """The NIXL expiry composition with its relation taken out: any timeout may fire at any time."""
    source = BUNDLED / "nixl_mla.yaml"
    text = source.read_text().replace("{spec: ", f"{{spec: {BUNDLED}/")
    start = text.index("relations:\n")
    end = text.index("\n\n", start)
    path = folder / "nixl_mla_untimed.yaml"
    path.write_text(text[:start] + text[end + 2 :])
    return path


def test_the_expiry_that_outlasts_the_read_never_frees_under_it() -> None:
    result = explore(BUNDLED / "nixl_mla.yaml")
    assert result.verdict == "verified"


def test_the_reversed_relation_frees_under_a_read_in_one_step() -> None:
    result = explore(BUNDLED / "nixl_mla_reversed.yaml")
    (broken,) = result.violated
    assert broken.name == "read_after_free" and broken.trace is not None
    assert [(s.role, s.cause, s.event) for s in broken.trace.moves] == [("prefill#0", "timeout", "expire")]


def test_a_trace_whose_timeout_the_relations_forbid_does_not_check() -> None:
    reversed_trace = explore(BUNDLED / "nixl_mla_reversed.yaml").violated[0].trace
    assert reversed_trace is not None
    check_trace(reversed_trace, load_system(BUNDLED / "nixl_mla_reversed.yaml"))
    with pytest.raises(TraceError, match="timeout cannot fire yet"):
        check_trace(reversed_trace, load_system(BUNDLED / "nixl_mla.yaml"))


def test_without_relations_any_timeout_fires_at_any_time(tmp_path: Path) -> None:
    system = load_system(without_relations(tmp_path))
    assert system.relations == ()
    assert status(system, "read_after_free") == "violated"


def test_relations_are_read_with_their_lines_and_turned_to_longer_first(tmp_path: Path) -> None:
    path = write_pingpong(
        tmp_path,
        edits={
            "requests: 2\n": "requests: 2\nrelations:\n  - server.idle_timeout > client.reply_timeout\n"
            "  - client.reply_timeout < server.idle_timeout\n"
        },
    )
    system = load_system(path)
    assert [(r.longer, r.shorter, r.loc.line) for r in system.relations] == [
        (("server", "idle_timeout"), (("client", "reply_timeout"),), 12),
        (("server", "idle_timeout"), (("client", "reply_timeout"),), 13),
    ]


@pytest.mark.parametrize(
    ("relation", "message"),
    [
        ("server.idle_timeout >= client.reply_timeout", "is not 'role.param > role.param"),
        ("idle_timeout > client.reply_timeout", "is not 'role.param > role.param"),
        ("server.idle_timeout + client.reply_timeout > client.reply_timeout", "has a sum on its longer side"),
    ],
)
def test_a_malformed_relation_is_a_schema_error(tmp_path: Path, relation: str, message: str) -> None:
    path = write_pingpong(tmp_path, edits={"requests: 2\n": f"requests: 2\nrelations: ['{relation}']\n"})
    with pytest.raises(SpecError, match=message):
        load_system(path)


@pytest.mark.parametrize(
    ("relations", "message"),
    [
        (["nobody.idle_timeout > client.reply_timeout"], "names 'nobody', which is not a role"),
        (["server.answer_timeout > client.reply_timeout"], "no state or phase of server has a timeout after 'answer_timeout'"),
        (
            ["server.idle_timeout > client.reply_timeout", "client.reply_timeout > server.idle_timeout"],
            "longer than itself",
        ),
    ],
)
def test_relations_name_real_timeouts_and_admit_some_timing(tmp_path: Path, relations: list[str], message: str) -> None:
    listed = "".join(f"  - {r}\n" for r in relations)
    path = write_pingpong(tmp_path, edits={"requests: 2\n": f"requests: 2\nrelations:\n{listed}"})
    found = [f for f in check_system(path) if f.code == "KVF213"]
    assert found and message in found[0].message


def test_timing_is_transitive_and_reads_a_sum_through_its_terms() -> None:
    a, b, c, d = ("x", "a"), ("y", "b"), ("z", "c"), ("w", "d")
    timing = Timing((TimeRelation(a, (b, c), "x.a > y.b + z.c"), TimeRelation(c, (d,), "z.c > w.d")))
    assert timing.outlasts(a, b) and timing.outlasts(a, c) and timing.outlasts(a, d)
    assert not timing.outlasts(b, a) and not timing.outlasts(b, d)
    assert timing.cycles() == []


def pingpong_timed(folder: Path) -> Path:
    """The server's idle timeout outlasts the client's reply timeout, which the client arms later (at ``ask``)."""
    return write_pingpong(
        folder, edits={"requests: 2\n": "requests: 2\nrelations: [server.idle_timeout > client.reply_timeout]\n"}
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda _t: BUNDLED / "nixl_mla.yaml", id="nixl_mla"),
        pytest.param(lambda _t: BUNDLED / "nixl_fanin.yaml", id="nixl_fanin"),
        pytest.param(pingpong_timed, id="armed-later"),
    ],
)
def test_every_timed_run_is_one_the_explorer_explores(tmp_path: Path, make: object) -> None:
    """Runs with real durations that keep the relations: each due timeout must be a move the explorer allows.

    Time is simulated: every other move happens after a random delay, a deadline
    fires exactly when due. If the deadline order ever forbade a timeout that
    falls due first, that timed run would be missing from the exploration.
    """
    assert callable(make)
    system = load_system(make(tmp_path)).expanded()
    local = LocalSystem(system)
    rng = random.Random(7)
    fired = 0
    for _run in range(300):
        durations = {
            r: {p: v * rng.uniform(0.5, 1.5) for p, v in role.spec.params.items()} for r, role in system.roles.items()
        }
        if any(
            durations[system.instances_of(rel.longer[0])[0]][rel.longer[1]]
            <= sum(durations[system.instances_of(r)[0]][p] for r, p in rel.shorter)
            for rel in system.relations
        ):
            continue  # these durations break a relation: no promise is made about them
        i, now = local.initial, 0.0
        armed = {
            k: 0.0
            for k, role in enumerate(local.roles)
            if _deadline(system, role.name, role.states[local.states[i][0][k]])
        }
        while local.states[i][0]:
            at = local.states[i][0]
            due = {
                k: t
                + durations[local.roles[k].name][_deadline(system, local.roles[k].name, local.roles[k].states[at[k]])]
                for k, t in armed.items()
            }
            moves = [(j, m) for j, m in local.moves[i] if j >= 0] + [(i, m) for m in local.loops[i]]
            others = [(j, m) for j, m in moves if m.cause != "timeout"]
            first = min(due, key=due.get) if due else None
            if first is None and not others:
                break  # stuck for good: what deadlock and liveness are about, not timing
            step = now + rng.expovariate(1 / 20)
            if first is not None and (not others or step >= due[first]):
                now = due[first]
                timeouts = [(j, m) for j, m in moves if m.cause == "timeout" and m.role == first]
                assert timeouts, (
                    f"{local.roles[first].name}'s deadline falls due first, but its timeout is not explored"
                )
                j, move = rng.choice(timeouts)
                fired += 1
            else:
                now = step
                j, move = rng.choice(others)
            i = j
            if move.action == "fire":
                state = local.roles[move.role].states[move.target]
                if _deadline(system, local.roles[move.role].name, state):
                    armed[move.role] = now
                else:
                    armed.pop(move.role, None)
    assert fired > 50  # the runs did reach the timeouts


def _deadline(system: System, role: str, state: str) -> str | None:
    """The param a role's state arms its deadline for, or None."""
    st = system.roles[role].spec.states.get(state)
    return str(st.timeout.after) if st is not None and st.timeout is not None else None
