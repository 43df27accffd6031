"""kvfsm.testing.strategies.specs: random specs that pass the checks, reach every feature (phases included), and read
back from YAML."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis.errors import NoSuchExample

import kvfsm
from kvfsm.spec import Spec, run_checks
from kvfsm.spec.model import ABORT, WILDCARD
from kvfsm.testing import LedgerDriver, run
from kvfsm.testing.strategies import as_yaml, specs

SETTINGS = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(specs())
def test_every_generated_spec_passes_the_static_checks_without_even_a_warning(spec: Spec) -> None:
    assert run_checks(spec) == [], as_yaml(spec)


@SETTINGS
@given(specs(error_path_actions=True))
def test_error_path_actions_break_only_the_rule_that_keeps_actions_off_the_error_path(spec: Spec) -> None:
    assert {f.code for f in run_checks(spec) if f.severity == "error"} <= {"KVF109"}, as_yaml(spec)


def _shape(spec: Spec) -> tuple[object, ...]:
    return (
        [(e.source, e.event, e.target, e.do) for e in spec.edges()],
        sorted((s, e) for s, e, _rule in spec.ignored()),
        {
            n: (s.initial, s.final, s.holds, s.waits_local, s.timeout and (s.timeout.after, s.timeout.fire))
            for n, s in spec.states.items()
        },
        {n: (r.acquire, r.release) for n, r in spec.resources.items()},
        dict(spec.params),
        spec.on_error,
        {n: (p.states, p.timeout.after, p.timeout.fire) for n, p in spec.phases.items()},
    )


@SETTINGS
@given(specs())
def test_a_generated_spec_reads_back_unchanged_from_its_yaml(spec: Spec) -> None:
    assert _shape(kvfsm.parse(as_yaml(spec), "random.yaml")) == _shape(spec)


def _entered(spec: Spec, state: str) -> set[str]:
    return {e.event for e in spec.edges() if e.target == state}


FEATURES: dict[str, Callable[[Spec], bool]] = {
    "acquire at begin": lambda s: any(s.resources[r].acquire for r in s.initial.holds),
    "resource held from begin without an acquire": lambda s: any(not s.resources[r].acquire for r in s.initial.holds),
    "two resources acquired on one edge": lambda s: any(
        sum(bool(s.resources[r].acquire) for r in s.acquires(e.source, e.target)) >= 2 for e in s.edges()
    ),
    "two resources released on one edge": lambda s: any(len(s.releases(e.source, e.target)) >= 2 for e in s.edges()),
    "a do shared by two transitions": lambda s: any(
        sum(t.do == d for t in s.transitions) >= 2 for d in {t.do for t in s.transitions if t.do}
    ),
    "a wildcard source": lambda s: any(t.wildcard for t in s.transitions),
    "a wildcard ignore rule": lambda s: any(WILDCARD in r.states for r in s.ignore),
    "an ignore rule in a live state": lambda s: any(not s.states[st].is_final for st, _e, _r in s.ignored()),
    "abort into a live state": lambda s: any(e.event == ABORT and not s.states[e.target].is_final for e in s.edges()),
    "abort with an action": lambda s: any(e.event == ABORT and e.do for e in s.edges()),
    "on_error into a live state": lambda s: any(
        e.event == s.on_error and not s.states[e.target].is_final for e in s.edges()
    ),
    "no on_error at all": lambda s: s.on_error is None,
    "a timeout after a param": lambda s: any(
        st.timeout and isinstance(st.timeout.after, str) for st in s.states.values()
    ),
    "a timeout due at once": lambda s: any(st.timeout and st.timeout.after == 0.0 for st in s.states.values()),
    "a timeout firing on_error": lambda s: any(
        st.timeout and st.timeout.fire == s.on_error for st in s.states.values()
    ),
    "a timeout self-loop with an action": lambda s: any(
        st.timeout and any(e.source == e.target == n and e.event == st.timeout.fire and e.do for e in s.edges())
        for n, st in s.states.items()
    ),
    "two timed states": lambda s: sum(st.timeout is not None for st in s.states.values()) >= 2,
    "a live state declared before the initial one": lambda s: next(iter(s.states)) != s.initial.name,
    "a phase": lambda s: bool(s.phases),
    "a phase over every live state ('*')": lambda s: any(p.states == (WILDCARD,) for p in s.phases.values()),
    "a phase begun in": lambda s: bool(s.phases_of(s.initial.name)),
    "a state's own timeout inside a phase": lambda s: any(s.states[st].timeout and s.phases_of(st) for st in s.live),
    "a move between two states of a phase": lambda s: any(
        e.source != e.target and set(s.phases_of(e.source)) & set(s.phases_of(e.target)) for e in s.edges()
    ),
    "a self-loop inside a phase": lambda s: any(e.source == e.target and s.phases_of(e.source) for e in s.edges()),
    "a phase after a param": lambda s: any(isinstance(p.timeout.after, str) for p in s.phases.values()),
}


def test_500_generated_specs_reach_every_feature_of_the_spec_language() -> None:
    seen: set[str] = set()

    @settings(max_examples=500, database=None, deadline=None, phases=[Phase.generate], derandomize=True)
    @given(specs())
    def collect(spec: Spec) -> None:
        seen.update(name for name, has in FEATURES.items() if has(spec))

    collect()
    assert sorted(set(FEATURES) - seen) == []


def test_shared_releases_are_generated_only_when_asked_for() -> None:
    def shares(s: Spec) -> bool:
        return len({r.release for r in s.resources.values()}) < len(s.resources)

    find(specs(shared_releases=True), shares, settings=settings(database=None))
    with pytest.raises(NoSuchExample):
        find(specs(), shares, settings=settings(max_examples=300, database=None))


def test_the_strategy_shrinks_towards_one_live_state_and_no_resources() -> None:
    smallest = find(specs(), lambda s: True, settings=settings(database=None))
    assert [n for n, st in smallest.states.items() if not st.is_final] == ["s0"]
    assert not smallest.resources


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(specs())
def test_model_based_tests_of_a_correct_driver_pass_on_random_specs(spec: Spec) -> None:
    report = run(spec, lambda: LedgerDriver(spec), examples=5, steps=20, seed=0)
    assert report.passed, "\n".join([as_yaml(spec), *report.story, report.error])


def test_limits_that_leave_no_spec_are_refused_with_what_to_pass() -> None:
    with pytest.raises(ValueError, match="at least one live state and one event"):
        specs(max_states=0)
