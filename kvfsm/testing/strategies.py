"""Hypothesis strategies for random machine specs that pass the static checks: inputs for properties of engines.

>>> from hypothesis import given, note
>>> from kvfsm.testing.strategies import as_yaml, specs
>>> @given(specs())
... def test_every_spec_releases_what_it_acquires(spec):
...     note(as_yaml(spec))  # a failing example shows its spec as spec-file text

The specs are :class:`~kvfsm.spec.Spec` models built directly (no YAML), and
every feature of the spec language's single-machine semantics shows up:
resources with and without acquire actions, held in any order (one without
is held from ``begin`` on, taken by the caller, never entered later); ``do``
actions shared between transitions; timeouts after a param or a literal (zero
included) firing any event their state handles; ``waits: local`` states;
``"*"`` sources; aborts into final states and into later live states (which
``close()`` must then release by force); an ``on_error`` event into a final
or a live state; ignore rules in live and final states, ``"*"`` included;
id spaces linked at ``begin`` and at an event, and events routed by them
(so the model-based tests deliver messages naming ids of every space);
phases (a deadline over a set of live states, ``"*"`` included, never
overlapping, whose event takes every state of the phase out of it, to a
final or a live state, while other moves stay inside it or loop). Shrinking
goes towards one live state, no resources, no id spaces, no phases and few
transitions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hypothesis import strategies as st

from ..spec.model import (
    ABORT,
    BEGIN,
    WILDCARD,
    EventDecl,
    FinalKind,
    IgnoreRule,
    Phase,
    Resource,
    Space,
    Spec,
    State,
    Timeout,
    Transition,
)

ON_ERROR = "fail"
"""The on_error event of generated specs (never used for anything else)."""

DO_ACTIONS = ("do_copy", "do_send", "do_ack", "do_cancel")
"""``do`` actions; several transitions may share one, as real specs do."""

FINALS: dict[str, FinalKind] = {"done": "success", "failed": "failure", "aborted": "failure"}

PARAMS = {"t_short": (0.5, 1.0), "t_long": (1.5, 2.0, 3.0)}
"""Params a timeout may name, and the values each may take."""

LITERAL_AFTERS = (0.0, 1.0, 2.5)
"""Seconds a timeout may give directly; 0.0 makes a deadline due at once."""

PEER_ID = "peer_id"
"""An id space linked at ``begin`` (a peer's request id)."""

XFER_ID = "xfer_id"
"""An id space linked at an event (a transfer id the event's payload carries)."""


def specs(
    *,
    max_states: int = 5,
    max_resources: int = 4,
    max_events: int = 4,
    error_path_actions: bool = False,
    shared_releases: bool = False,
) -> st.SearchStrategy[Spec]:
    """Random machine specs with up to ``max_states`` live states, ``max_resources`` resources and
    ``max_events`` events besides abort and on_error, each passing :func:`kvfsm.spec.verify`.

    ``error_path_actions=True`` also gives on_error transitions ``do``
    actions, so that an error raised while handling an error can happen;
    such specs break one rule only, KVF109, and the engine still runs them.
    ``shared_releases=True`` lets two resources name one release action
    (KVF112): the engine then calls it once per resource, with the key only,
    so a driver cannot tell which one goes; fine for testing the engine's
    calls, not a driver's holdings.
    """
    if max_states < 1 or max_resources < 0 or max_events < 1:
        raise ValueError(
            f"specs(max_states={max_states}, max_resources={max_resources}, max_events={max_events}): "
            "a spec needs at least one live state and one event; resources may be 0"
        )
    return _specs(max_states, max_resources, max_events, error_path_actions, shared_releases)


Edges = dict[tuple[str, str], tuple[str, str | None]]
"""(source, event) → (target, do): one transition per pair, so KVF105 holds by construction."""


@st.composite
def _specs(
    draw: st.DrawFn, max_states: int, max_resources: int, max_events: int, error_actions: bool, shared: bool
) -> Spec:
    n = draw(st.integers(1, max_states), label="live states")
    live = [f"s{i}" for i in range(n)]
    resources = _resources(draw, max_resources, shared)
    holds = {
        s: tuple(draw(st.lists(st.sampled_from(sorted(resources)), unique=True))) if resources else () for s in live
    }
    events = [f"e{i}" for i in range(draw(st.integers(1, max_events), label="events"))]
    edges: Edges = {}
    do = st.none() | st.sampled_from(DO_ACTIONS)

    # Every live state is reached from an earlier one (no KVF102), and some event leads to done.
    for i in range(1, n):
        source = live[draw(st.integers(0, i - 1))]
        edges[source, _free_event(draw, events, source, edges)] = (live[i], draw(do))
    for source in live:
        for event in events:
            if (source, event) not in edges and draw(st.integers(0, 3)) == 0:
                edges[source, event] = (draw(st.sampled_from([*live, "done", "failed"])), draw(do))
    if not any(target == "done" for target, _do in edges.values()):
        source = draw(st.sampled_from(live))
        edges[source, _free_event(draw, events, source, edges)] = ("done", draw(do))

    # Abort everywhere (KVF108): into aborted, or into a later live state, so every abort chain ends final (KVF103).
    for i, source in enumerate(live):
        later = live[i + 1 :]
        target = draw(st.sampled_from(later)) if later and draw(st.integers(0, 3)) == 0 else "aborted"
        edges[source, ABORT] = (target, draw(st.none() | st.just("do_cancel")))

    spec_resources = {r.name: r for r in resources.values()}
    phases = _phases(draw, live, events, edges)
    on_error = _error_paths(draw, live, holds, edges, spec_resources, error_actions)

    _taken_only_at_begin(holds, edges, spec_resources)

    states_in_order = draw(st.permutations(live), label="declaration order")
    timed = {s: _timeout(draw, s, edges) for s in live}
    drawn = {p: draw(st.sampled_from(values)) for p, values in PARAMS.items()}
    _phases_can_fire(phases, timed, drawn)
    targets = {target for target, _do in edges.values()}
    states = {
        s: State(s, initial=s == "s0", holds=holds[s], waits_local=timed[s] is None, timeout=timed[s])
        for s in states_in_order
    }
    states.update({f: State(f, final=kind) for f, kind in FINALS.items() if f in targets})
    afters = [*(t.after for t in timed.values() if t is not None), *(p.timeout.after for p in phases.values())]
    params = {p: drawn[p] for p in sorted({a for a in afters if isinstance(a, str)})}
    transitions = _transitions(draw, edges, live)
    spaces, decls, transitions = _id_spaces(draw, transitions, on_error)
    return Spec(
        name="random",
        key="request_id",
        states=states,
        transitions=transitions,
        resources=spec_resources,
        params=params,
        ignore=_ignore_rules(draw, edges, list(states)),
        on_error=on_error,
        path="<kvfsm.testing.strategies.specs>",
        begin_payload=(PEER_ID,) if PEER_ID in spaces else (),
        spaces=spaces,
        event_decls=decls,
        phases=phases,
    )


def _phases_can_fire(phases: dict[str, Phase], timed: dict[str, Timeout | None], params: dict[str, float]) -> None:
    """Make sure, in place, that each phase has a state where its deadline is the first due: the state's own
    deadline later (or none), and every other phase spanning it later too (at the same time, declared after).
    Where only its own timeout stands in the way, the first state of the phase loses it; else the phase goes
    (its event stays, fired by hand). Otherwise no run could ever exercise the phase's deadline."""

    def seconds(after: str | float) -> float:
        return params[after] if isinstance(after, str) else after

    def span(phase: Phase) -> list[str]:
        return [s for s in timed if phase.states == (WILDCARD,) or s in phase.states]

    order = list(phases)
    for name in order:
        due = (seconds(phases[name].timeout.after), order.index(name))
        rivals = [
            span(other)
            for o, other in phases.items()
            if o != name and (seconds(other.timeout.after), order.index(o)) < due
        ]
        inside = [s for s in span(phases[name]) if not any(s in rival for rival in rivals)]
        if any((own := timed[s]) is None or seconds(own.after) > due[0] for s in inside):
            continue
        if inside:
            timed[inside[0]] = None
        else:
            del phases[name]


def _phases(draw: st.DrawFn, live: Sequence[str], events: list[str], edges: Edges) -> dict[str, Phase]:
    """Now and then a phase or two: some live states (all of them, sometimes written ``"*"``), a deadline after a
    param or a literal, firing an event that takes each of its states out of it (KVF118): an existing one where it
    already does, or one added from every state of the phase, into ``failed``, ``done`` or a live state outside."""
    out: dict[str, Phase] = {}
    free = list(live)  # phases do not overlap here: where two share a state, one may never be first due there,
    # so an edge its event adds could never be taken (overlaps are the hand-written leases spec's, in the
    # differential test)
    for i in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]), label="phases")):
        if not free:
            break
        name = f"p{i}"
        inside = draw(st.lists(st.sampled_from(free), unique=True, min_size=1), label="phase states")
        free = [s for s in free if s not in inside]
        outside = [s for s in live if s not in inside]
        fits = [e for e in events if all((s, e) not in edges or edges[s, e][0] not in inside for s in inside)]
        event = draw(st.sampled_from([f"lapse{i}", *fits]), label="phase event")
        if event not in events:
            events.append(event)
        for source in inside:
            if (source, event) not in edges:
                edges[source, event] = (
                    draw(st.sampled_from(["failed", "done", *outside])),
                    draw(st.none() | st.just("do_copy")),
                )
        after = draw(st.one_of(st.sampled_from(sorted(PARAMS)), st.sampled_from(LITERAL_AFTERS)))
        states = (
            (WILDCARD,) if len(inside) == len(live) and draw(st.booleans()) else tuple(s for s in live if s in inside)
        )
        out[name] = Phase(name, states, Timeout(after, event))
    return out


def _id_spaces(
    draw: st.DrawFn, transitions: tuple[Transition, ...], on_error: str | None
) -> tuple[dict[str, Space], dict[str, EventDecl], tuple[Transition, ...]]:
    """Sometimes a space linked at begin and one linked at an event (whose transitions then carry it), and events
    routed by the key or by either space (never abort or on_error: what the engine fires stays the key's)."""
    if not draw(st.booleans(), label="id spaces"):
        return {}, {}, transitions
    spaces = {PEER_ID: Space(PEER_ID, BEGIN)}
    events = sorted({t.event for t in transitions} - {ABORT, on_error or ABORT})
    linked: bool = bool(events) and draw(st.booleans(), label="a space linked at an event")
    if linked:
        at = draw(st.sampled_from(events))
        spaces[XFER_ID] = Space(XFER_ID, at)
        transitions = tuple(dataclasses.replace(t, payload=(XFER_ID,)) if t.event == at else t for t in transitions)
    routed = draw(st.lists(st.sampled_from(events), unique=True), label="routed events") if events else []
    by = st.sampled_from(["request_id", *spaces])
    decls = {e: EventDecl(e, draw(by)) for e in routed}
    return spaces, decls, transitions


def _resources(draw: st.DrawFn, most: int, shared: bool) -> dict[str, Resource]:
    """Up to ``most`` resources, about half with an acquire action; with ``shared``, now and then two share a release."""
    out: dict[str, Resource] = {}
    for i in range(draw(st.integers(0, most), label="resources")):
        name = f"r{i}"
        release = f"free_{name}"
        if shared and out and draw(st.integers(0, 4)) == 0:
            release = draw(st.sampled_from(sorted({r.release for r in out.values()})))
        acquire = f"take_{name}" if draw(st.booleans()) else None
        out[name] = Resource(name, release, acquire)
    return out


def _taken_only_at_begin(holds: dict[str, tuple[str, ...]], edges: Edges, resources: dict[str, Resource]) -> None:
    """Drop, in place, a resource without an acquire action from every state a transition enters it in.

    Such a resource is taken by the caller before ``begin``; entered later, on
    a timeout or an abort, no one would take it, and a model-based test could
    not tell its driver to. Only resources without acquire actions are
    dropped, so which actions can raise on which edge does not change.
    """
    changed = True
    while changed:
        changed = False
        for (source, _event), (target, _do) in edges.items():
            kept = tuple(r for r in holds.get(target, ()) if resources[r].acquire or r in holds[source])
            if target in holds and kept != holds[target]:
                holds[target], changed = kept, True


def _free_event(draw: st.DrawFn, events: list[str], source: str, edges: Edges) -> str:
    """An event ``source`` has no transition for yet (a new one if all are taken)."""
    free = [e for e in events if (source, e) not in edges]
    if not free:
        events.append(f"e{len(events)}")
        return events[-1]
    return draw(st.sampled_from(free))


def _raises(
    source: str, target: str, do: str | None, holds: dict[str, tuple[str, ...]], resources: dict[str, Resource]
) -> bool:
    """Whether an action can raise on source → target: its do, or an acquire of what target adds."""
    have = set(holds.get(source, ()))
    return do is not None or any(resources[r].acquire for r in holds.get(target, ()) if r not in have)


def _error_paths(
    draw: st.DrawFn,
    live: Sequence[str],
    holds: dict[str, tuple[str, ...]],
    edges: Edges,
    resources: dict[str, Resource],
    with_actions: bool,
) -> str | None:
    """The on_error event and its transitions: from every state where an action can raise (KVF109), and maybe more.

    Its target is failed, or a live state it can enter without an acquire
    action (the path that handles an error must not raise itself).
    """
    risky = [
        s for s in live if any(_raises(s, t, d, holds, resources) for (src, _e), (t, d) in edges.items() if src == s)
    ]
    if not risky and not draw(st.booleans()):
        return None
    extra = [s for s in live if s not in risky and draw(st.booleans())]
    for source in [*risky, *extra] or [live[0]]:
        safe = [t for t in live if not _raises(source, t, None, holds, resources)]
        target = draw(st.sampled_from(["failed", *safe])) if safe and draw(st.integers(0, 2)) == 0 else "failed"
        edges[source, ON_ERROR] = (target, draw(st.none() | st.sampled_from(DO_ACTIONS)) if with_actions else None)
    return ON_ERROR


def _timeout(draw: st.DrawFn, state: str, edges: Edges) -> Timeout | None:
    """No timeout (the state then ``waits: local``), or one firing an event the state handles (KVF106)."""
    if not draw(st.booleans()):
        return None
    handled = sorted(e for (s, e) in edges if s == state)
    after = draw(st.one_of(st.sampled_from(sorted(PARAMS)), st.sampled_from(LITERAL_AFTERS)))
    return Timeout(after, draw(st.sampled_from(handled)))


def _transitions(draw: st.DrawFn, edges: Edges, live: Sequence[str]) -> tuple[Transition, ...]:
    """Edges with the same event, target and do as one transition; from every live state, sometimes ``"*"``."""
    grouped: dict[tuple[str, str, str | None], list[str]] = {}
    for (source, event), (target, do) in edges.items():
        grouped.setdefault((event, target, do), []).append(source)
    out = []
    for (event, target, do), sources in grouped.items():
        ordered = tuple(s for s in live if s in sources)
        if len(ordered) == len(live) and draw(st.booleans()):
            ordered = (WILDCARD,)
        out.append(Transition(event, ordered, target, do))
    return tuple(out)


def _ignore_rules(draw: st.DrawFn, edges: Edges, states: Sequence[str]) -> tuple[IgnoreRule, ...]:
    """Late events ignored where they have no transition (KVF110): in chosen states, or ``"*"`` (all such)."""
    events = sorted({e for (_s, e) in edges})
    rules = []
    for event in draw(st.lists(st.sampled_from(events), unique=True, max_size=3), label="ignored events"):
        unhandled = [s for s in states if (s, event) not in edges]
        if not unhandled:
            continue
        if draw(st.integers(0, 3)) == 0:
            rules.append(IgnoreRule((event,), (WILDCARD,)))
        else:
            chosen = draw(st.lists(st.sampled_from(unhandled), unique=True, min_size=1))
            rules.append(IgnoreRule((event,), tuple(chosen)))
    return tuple(rules)


def as_yaml(spec: Spec) -> str:
    """``spec`` as spec-file text, to read or paste into a file when a property fails on a generated spec.

    Covers what :func:`specs` generates (no docs or sends); ``kvfsm.parse`` reads it back unchanged.
    """
    lines = ["kvfsm: 1", f"machine: {spec.name}", f"key: {spec.key}"]
    if spec.spaces:
        lines.append("spaces:")
        lines += [f"  {sp.name}: {{linked_at: {sp.linked_at}}}" for sp in spec.spaces.values()]
    if spec.event_decls:
        lines.append("events:")
        lines += [
            f"  {d.name}: {{by: {d.by}{', remote: true' if d.remote else ''}}}" for d in spec.event_decls.values()
        ]
    if spec.begin_payload:
        lines.append(f"begin: {{payload: [{', '.join(spec.begin_payload)}]}}")
    if spec.params:
        lines.append("params: {" + ", ".join(f"{k}: {v}" for k, v in spec.params.items()) + "}")
    if spec.resources:
        lines.append("resources:")
        for r in spec.resources.values():
            acquire = f"acquire: {r.acquire}, " if r.acquire else ""
            lines.append(f"  {r.name}: {{{acquire}release: {r.release}}}")
    lines.append("states:")
    for state in spec.states.values():
        parts = ["initial: true"] if state.initial else []
        parts += [f"final: {state.final}"] if state.final else []
        parts += [f"holds: [{', '.join(state.holds)}]"] if state.holds else []
        parts += ["waits: local"] if state.waits_local else []
        if state.timeout is not None:
            parts.append(f"timeout: {{after: {state.timeout.after}, fire: {state.timeout.fire}}}")
        lines.append(f"  {state.name}: {{{', '.join(parts)}}}")
    lines.append("transitions:")
    for t in spec.transitions:
        sources = ", ".join(f'"{s}"' if s == WILDCARD else s for s in t.sources)
        do = f", do: {t.do}" if t.do else ""
        payload = f", payload: [{', '.join(t.payload)}]" if t.payload else ""
        lines.append(f"  - {{event: {t.event}, from: [{sources}], to: {t.target}{do}{payload}}}")
    if spec.ignore:
        lines.append("ignore:")
        for rule in spec.ignore:
            states = ", ".join(f'"{s}"' if s == WILDCARD else s for s in rule.states)
            lines.append(f"  - {{event: [{', '.join(rule.events)}], in: [{states}]}}")
    if spec.on_error is not None:
        lines.append(f"on_error: {spec.on_error}")
    if spec.phases:
        lines.append("phases:")
        for phase in spec.phases.values():
            states = ", ".join(f'"{s}"' if s == WILDCARD else s for s in phase.states)
            timeout = f"{{after: {phase.timeout.after}, fire: {phase.timeout.fire}}}"
            lines.append(f"  {phase.name}: {{states: [{states}], timeout: {timeout}}}")
    return "\n".join(lines) + "\n"


__all__ = ["ON_ERROR", "as_yaml", "specs"]
