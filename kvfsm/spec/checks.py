"""Static checks KVF101–KVF120: properties proved over a spec's transition graph.

Every check works on the expanded edge set of the model (``Spec.edges``), so a
wildcard source, a timeout or an ``on_error`` path is seen exactly as the
engine will run it. Reachability questions are answered by graph search, not
by looking for keywords.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable

from .findings import Finding, Severity
from .model import ABORT, BEGIN, Edge, Loc, Spec, Transition

Check = Callable[[Spec], Iterable[Finding]]


def _finding(code: str, loc: Loc, message: str, fix: str, severity: Severity = "error") -> Finding:
    return Finding(code, severity, loc.path, loc.line, message, fix, loc.col)


def _valid_edges(spec: Spec) -> list[Edge]:
    """Edges whose endpoints exist (KVF106 reports the others)."""
    return [e for e in spec.edges() if e.source in spec.states and e.target in spec.states]


def _accepts(spec: Spec) -> dict[str, dict[str, list[Edge]]]:
    table: dict[str, dict[str, list[Edge]]] = defaultdict(lambda: defaultdict(list))
    for e in _valid_edges(spec):
        table[e.source][e.event].append(e)
    return table


def _closure(start: set[str], arcs: Iterable[tuple[str, str]]) -> set[str]:
    """Every node reachable from ``start`` along ``arcs`` (breadth-first)."""
    succ: dict[str, set[str]] = defaultdict(set)
    for a, b in arcs:
        succ[a].add(b)
    seen = set(start)
    todo = deque(start)
    while todo:
        for nxt in succ[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def check_initial(spec: Spec) -> Iterable[Finding]:
    """KVF101: exactly one initial state."""
    initial = [s for s in spec.states.values() if s.initial]
    if not initial:
        loc = spec.locs.get("states", Loc(spec.path, 1))
        yield _finding(
            "KVF101", loc, "no state is marked initial", "Mark the state a request starts in with 'initial: true'."
        )
    for extra in initial[1:]:
        yield _finding(
            "KVF101",
            extra.loc,
            f"state {extra.name!r} is a second initial state (the first is {initial[0].name!r})",
            "Keep 'initial: true' on exactly one state.",
        )


def check_references(spec: Spec) -> Iterable[Finding]:
    """KVF106: every state, event, resource and param that is named is declared."""
    events = set(spec.events)
    declared = ", ".join(spec.states) or "none"
    for t in spec.transitions:
        for src in t.sources:
            if src != "*" and src not in spec.states:
                yield _finding(
                    "KVF106",
                    t.loc,
                    f"transition {t.event!r} starts from undeclared state {src!r}",
                    f"Declare it under 'states:' or use one of: {declared}.",
                )
        if t.target not in spec.states:
            yield _finding(
                "KVF106",
                t.loc,
                f"transition {t.event!r} goes to undeclared state {t.target!r}",
                f"Declare it under 'states:' or use one of: {declared}.",
            )
    for state in spec.states.values():
        for r in state.holds:
            if r not in spec.resources:
                yield _finding(
                    "KVF106",
                    state.loc,
                    f"state {state.name!r} holds undeclared resource {r!r}",
                    "Declare it under 'resources:' with the action that releases it: '{release: <method>}'.",
                )
        if isinstance(state.warn_after, str) and state.warn_after not in spec.params:
            yield _finding(
                "KVF106",
                state.loc,
                f"state {state.name!r} warns after undeclared param {state.warn_after!r}",
                "Declare it under 'params:' or write the seconds directly.",
            )
        if state.timeout is not None:
            after = state.timeout.after
            if isinstance(after, str) and after not in spec.params:
                yield _finding(
                    "KVF106",
                    state.timeout.loc,
                    f"state {state.name!r} times out after undeclared param {after!r}",
                    f"Declare it under 'params:' (e.g. '{after}: 30.0') or write the seconds directly.",
                )
            fire = state.timeout.fire
            if not spec.accepts(state.name, fire) and not state.is_final:  # a final's timeout is KVF111 already
                only_ignored = (state.name, fire) in spec.ignores
                how = (
                    "only ignores: the deadline would pass and nothing would happen"
                    if only_ignored
                    else "does not accept"
                )
                yield _finding(
                    "KVF106",
                    state.timeout.loc,
                    f"state {state.name!r} times out by firing {fire!r}, which it {how}",
                    f"Add a transition '{{event: {fire}, from: {state.name}, to: <state>}}' or fire an event it accepts.",
                )
    if spec.on_error is not None and spec.on_error not in events:
        loc = spec.locs.get("on_error", Loc(spec.path, 1))
        yield _finding(
            "KVF106",
            loc,
            f"on_error names {spec.on_error!r}, which no transition handles",
            "Name an event that has transitions (usually 'fail').",
        )
    for rule in spec.ignore:
        for ev in rule.events:
            if ev not in events:
                yield _finding(
                    "KVF106",
                    rule.loc,
                    f"ignore rule names event {ev!r}, which no transition handles",
                    "Ignore only events the machine knows; remove it or fix the spelling.",
                )
        for st in rule.states:
            if st != "*" and st not in spec.states:
                yield _finding(
                    "KVF106", rule.loc, f"ignore rule names undeclared state {st!r}", f"Use one of: {declared}."
                )


def check_reachable(spec: Spec) -> Iterable[Finding]:
    """KVF102: every state is reachable from the initial state."""
    try:
        start = spec.initial.name
    except LookupError:
        return
    seen = _closure({start}, [(e.source, e.target) for e in _valid_edges(spec)])
    for state in spec.states.values():
        if state.name not in seen:
            yield _finding(
                "KVF102",
                state.loc,
                f"state {state.name!r} cannot be reached from the initial state {start!r}",
                "Add a transition into it, or delete it.",
                "warning",
            )


def check_can_finish(spec: Spec) -> Iterable[Finding]:
    """KVF103: from every state some final state is reachable (no trap, no closed cycle)."""
    finishing = _closure(set(spec.finals), [(e.target, e.source) for e in _valid_edges(spec)])
    for state in spec.states.values():
        if state.name not in finishing:
            yield _finding(
                "KVF103",
                state.loc,
                f"no final state can be reached from state {state.name!r}: a request there never finishes{_keeping(state.holds, ' and never releases ')}",
                "Add a way out (abort, fail or a timeout) that leads to a final state.",
            )


def _keeping(holds: tuple[str, ...], lead: str) -> str:
    """``lead`` + the held resources, or nothing for a state that holds none."""
    return f"{lead}{', '.join(holds)}" if holds else ""


def check_finals(spec: Spec) -> Iterable[Finding]:
    """KVF104 and KVF111: final states hold nothing and have no way out."""
    for state in spec.states.values():
        if not state.is_final:
            continue
        if state.holds:
            yield _finding(
                "KVF104",
                state.loc,
                f"final state {state.name!r} holds {', '.join(state.holds)}: a finished request would keep them forever",
                "Remove 'holds' from final states; resources are released on the way in.",
            )
        if state.timeout is not None:
            yield _finding(
                "KVF111",
                state.timeout.loc,
                f"final state {state.name!r} has a timeout, but a finished request has nothing left to wait for",
                "Remove the timeout.",
            )
    for t in spec.transitions:
        for src in t.sources:
            st = spec.states.get(src)
            if st is not None and st.is_final:
                yield _finding(
                    "KVF111",
                    t.loc,
                    f"transition {t.event!r} leaves final state {src!r}: a finished request is retired and cannot move",
                    f"Drop {src!r} from 'from'; to accept late {t.event!r} events there, add it to an 'ignore' rule.",
                )


def check_deterministic(spec: Spec) -> Iterable[Finding]:
    """KVF105: at most one transition per (state, event)."""
    first: dict[tuple[str, str], Edge] = {}
    for e in spec.edges():
        prior = first.setdefault((e.source, e.event), e)
        if prior is not e and prior.transition is not e.transition:
            where = f"line {prior.transition.loc.line}"
            what = (
                f"goes to {e.target!r} here but to {prior.target!r} at {where}"
                if prior.target != e.target
                else f"is declared again (first at {where})"
            )
            yield _finding(
                "KVF105",
                e.transition.loc,
                f"event {e.event!r} in state {e.source!r} {what}",
                "Keep one transition per (state, event); narrow a '*' source by listing states.",
            )


def check_waiting(spec: Spec) -> Iterable[Finding]:
    """KVF107: every live state either times out or is left only by local code."""
    for state in spec.states.values():
        if state.is_final or state.timeout is not None or state.waits_local or spec.phases_of(state.name):
            continue
        if any((state.name, o.ended) in spec.table for o in spec.owns.values()):
            continue  # it waits for its children to end, and each child's own spec bounds its waits
        yield _finding(
            "KVF107",
            state.loc,
            f"state {state.name!r} has no timeout and is not 'waits: local' — a remote peer that never answers would pin it there forever{_keeping(state.holds, ', holding ')}",
            "Add 'timeout: {after: <param>, fire: expire}', or mark it 'waits: local' only if local code alone "
            "moves it on (a state a remote notification leaves needs the timeout: 'waits: local' would hide the hang).",
        )


def check_abortable(spec: Spec) -> Iterable[Finding]:
    """KVF108: abort is accepted in every live state."""
    table = _accepts(spec)
    for state in spec.states.values():
        if not state.is_final and not table[state.name].get(ABORT):
            yield _finding(
                "KVF108",
                state.loc,
                f"state {state.name!r} does not accept {ABORT!r}: a request aborted there keeps running{_keeping(state.holds, ' and keeps ')}",
                f"Add '{state.name}' to the 'from' of the abort transition, or use 'from: \"*\"'.",
            )


def check_error_paths(spec: Spec) -> Iterable[Finding]:
    """KVF109: wherever an action can raise, the on_error event is accepted and cannot itself raise."""
    table = _accepts(spec)
    flagged: set[str] = set()
    unhandled: set[Transition] = set()
    for e in _valid_edges(spec):
        actions = spec.raising_actions(e)
        if not actions or e.source in flagged:
            continue
        if spec.on_error is None:  # one finding per transition: the fix is the same for all its sources
            if e.transition in unhandled:
                continue
            unhandled.add(e.transition)
            yield _finding(
                "KVF109",
                e.transition.loc,
                f"action {actions[0]!r} on {e.event!r} from {e.source!r} can raise, and the spec has no 'on_error' event to fire when it does",
                "Add 'on_error: fail' (and a 'fail' transition from every state with an action).",
            )
            continue
        handlers = table[e.source].get(spec.on_error)
        if not handlers:
            flagged.add(e.source)
            yield _finding(
                "KVF109",
                e.transition.loc,
                f"action {actions[0]!r} on {e.event!r} from {e.source!r} can raise, but {e.source!r} does not accept the on_error event {spec.on_error!r}",
                f"Add '{e.source}' to the 'from' of the {spec.on_error!r} transition.",
            )
            continue
        handler = handlers[0]
        risky = spec.raising_actions(handler)
        if risky:
            flagged.add(e.source)
            yield _finding(
                "KVF109",
                handler.transition.loc,
                f"the on_error path from {e.source!r} runs {risky[0]!r}, which can raise too — an error while handling an error has no handler",
                "Keep the on_error transition free of 'do' and of resources with 'acquire'; cleanup belongs in release actions.",
            )


def check_ignore_overlap(spec: Spec) -> Iterable[Finding]:
    """KVF110: an event is never both handled and ignored in the same state."""
    table = _accepts(spec)
    for state, event, rule in spec.ignored():
        if table[state].get(event):
            yield _finding(
                "KVF110",
                rule.loc,
                f"event {event!r} is ignored in state {state!r}, which also has a transition for it",
                f"Remove {state!r} from this ignore rule or the transition's 'from'.",
            )


def check_release_actions(spec: Spec) -> Iterable[Finding]:
    """KVF112: each resource has a release action of its own."""
    first: dict[str, str] = {}
    for r in spec.resources.values():
        other = first.setdefault(r.release, r.name)
        if other != r.name:
            yield _finding(
                "KVF112",
                r.loc,
                f"resources {other!r} and {r.name!r} are both released by {r.release}(): it is called once per "
                "resource with the key alone, so it cannot tell which of them is going (and frees both twice)",
                f"Give {r.name!r} a release action of its own, e.g. 'release: {r.release}_{r.name}'.",
            )


def check_relations(spec: Spec) -> Iterable[Finding]:
    """KVF106 and KVF113: a relation names declared params, and the spec's own values keep it."""
    for relation in spec.relations:
        unknown = [p for p in relation.params if p not in spec.params]
        if unknown:
            declared = ", ".join(spec.params) or "none"
            yield _finding(
                "KVF106",
                relation.loc,
                f"relation {relation.text!r} names undeclared param(s) {', '.join(map(repr, unknown))}",
                f"Declare them under 'params:' or use one of: {declared}.",
            )
        elif not relation.holds(spec.params):
            yield _finding(
                "KVF113",
                relation.loc,
                f"the spec's own params break relation {relation.text!r} ({relation.given(spec.params)})",
                "Change the params' values so the relation holds, or fix the relation.",
            )


def check_id_spaces(spec: Spec) -> Iterable[Finding]:
    """KVF106 for id spaces and event declarations: every name they use is declared, every space is linked."""
    events = set(spec.events)
    for space in spec.spaces.values():
        if space.name == spec.key:
            yield _finding(
                "KVF106", space.loc, f"id space {space.name!r} is the key's own", "List only the other spaces."
            )
            continue
        carried = set(spec.begin_payload) if space.linked_at == BEGIN else spec.payloads.get(space.linked_at)
        if carried is None:
            yield _finding(
                "KVF106",
                space.loc,
                f"id space {space.name!r} is linked at {space.linked_at!r}, which is neither 'begin' nor an event "
                "with a transition: nothing would ever link it, so every message naming it would be unknown",
                f"Write 'linked_at: begin' or an event that has a transition (one of: {', '.join(spec.events)}).",
            )
        elif space.name not in carried:
            where = "begin: {payload: [...]}" if space.linked_at == BEGIN else f"the {space.linked_at!r} transitions"
            yield _finding(
                "KVF106",
                space.loc,
                f"id space {space.name!r} is linked at {space.linked_at!r}, whose payload does not carry {space.name!r}",
                f"Add {space.name!r} to the payload of {where}.",
            )
    ignorable = {e for rule in spec.ignore for e in rule.events}
    for decl in spec.event_decls.values():
        if decl.name not in events and decl.name not in ignorable:
            yield _finding(
                "KVF106",
                decl.loc,
                f"events declares {decl.name!r}, which no transition or ignore rule names",
                "Declare only events the machine knows; remove it or fix the spelling.",
            )
        yield from _undeclared_space(spec, decl.by, decl.loc, f"event {decl.name!r} is routed by")


def check_outgoing(spec: Spec) -> Iterable[Finding]:
    """KVF106 for outgoing messages: the id space each one carries is the key's or a declared one."""
    for message in spec.outgoing.values():
        what = f"outgoing message {message.name!r} carries an id from"
        yield from _undeclared_space(spec, message.carries, message.loc, what)


def _undeclared_space(spec: Spec, space: str, loc: Loc, what: str) -> Iterable[Finding]:
    """KVF106 when ``space`` is neither the key's nor declared under ``spaces:``; ``what`` says who names it."""
    if space != spec.key and space not in spec.spaces:
        known = ", ".join([spec.key, *spec.spaces])
        yield _finding(
            "KVF106",
            loc,
            f"{what} undeclared id space {space!r}",
            f"Declare it under 'spaces:' with where it is linked, or use one of: {known}.",
        )


def check_remote_events(spec: Spec) -> Iterable[Finding]:
    """KVF114 and KVF115: a remote event is expected everywhere; a state only remote events leave is not local."""
    table = _accepts(spec)
    ignored = {(state, event) for state, event, _rule in spec.ignored()}
    for decl in spec.event_decls.values():
        if not decl.remote:
            continue
        missing = [n for n in spec.states if not table[n].get(decl.name) and (n, decl.name) not in ignored]
        if missing:
            yield _finding(
                "KVF114",
                decl.loc,
                f"remote event {decl.name!r} is neither handled nor ignored in {', '.join(map(repr, missing))}: a peer's "
                "late or duplicate message there would be an IllegalTransition",
                f"Add an ignore rule '{{event: {decl.name}, in: [{', '.join(missing)}]}}' or handle it there.",
            )
    local_exits = {ABORT, spec.on_error}
    for state in spec.states.values():
        if state.is_final or not state.waits_local:
            continue
        exits = {e for e in table[state.name] if e not in local_exits}
        if exits and all(spec.is_remote(e) for e in exits):
            yield _finding(
                "KVF115",
                state.loc,
                f"state {state.name!r} is 'waits: local', but only remote events ({', '.join(sorted(exits))}) move it "
                "on: a peer that never answers would pin it forever, and 'waits: local' hides exactly that hang",
                "Replace 'waits: local' with 'timeout: {after: <param>, fire: expire}'.",
            )


def check_counts(spec: Spec) -> Iterable[Finding]:
    """KVF116: a counted transition says where K comes from, leaves its state, and is not a local exit."""
    local = {ABORT, spec.on_error} | {t.fire for st in spec.states for t in spec.timeouts(st)}
    for t in spec.transitions:
        if "sender" in t.payload:
            yield _finding(
                "KVF116", t.loc, f"transition on {t.event!r} declares payload 'sender', which the engine keeps "
                "for the identity of who sent a counted event",
                "Rename the payload key; to count who sent it, write 'count: K' on the transition.",
            )  # fmt: skip
        if t.count is None:
            continue
        where = f"counted transition on {t.event!r}"
        source = spec.count_source(t)
        if source is None:
            yield _finding(
                "KVF116", t.loc, f"{where} counts {t.count!r}, which is neither a param, a 'begin' payload key nor "
                "a key of its own payload: nothing says how many senders it waits for",
                f"Declare {t.count!r} under 'params:', in 'begin: {{payload: [...]}}', or in this transition's "
                "'payload: [...]'; or write the number.",
            )  # fmt: skip
        elif source[0] == "param" and not float(spec.params[str(source[1])]).is_integer():
            yield _finding(
                "KVF116", t.loc, f"{where} counts param {source[1]!r}, whose value {spec.params[str(source[1])]} "
                "is not a whole number", "Give the param a whole number of senders (0 or more).",
            )  # fmt: skip
        if t.wildcard or t.event in local:
            yield _finding(
                "KVF116", t.loc, f"{where}: abort, on_error, a timeout's event and '*' transitions are the local "
                "way out of a state and must never wait for senders", "Count a peer's message, not a way out.",
            )  # fmt: skip
        if t.target in t.sources:
            yield _finding(
                "KVF116", t.loc, f"{where} loops back to {t.target!r}: the count lives for one stay in the state, "
                "so the K-th sender would end it and the next ones count again",
                "Send the counted transition to another state (a self-loop may sit beside it; it keeps the count).",
            )  # fmt: skip


def check_early(spec: Spec) -> Iterable[Finding]:
    """KVF117: an early event waits a known time, for ids that can appear."""
    for decl in spec.event_decls.values():
        early = decl.early
        if early is None:
            continue
        if isinstance(early.within, str) and early.within not in spec.params:
            yield _finding(
                "KVF117", early.loc, f"early event {decl.name!r} waits within undeclared param {early.within!r}",
                f"Declare it under 'params:' (e.g. '{early.within}: 30.0') or write the seconds.",
            )  # fmt: skip
        space = spec.spaces.get(decl.by)
        if decl.by != spec.key and space is not None and space.linked_at not in (BEGIN, *spec.events):
            yield _finding(
                "KVF117", early.loc, f"early event {decl.name!r} waits for ids of {decl.by!r}, which no event links "
                f"({space.linked_at!r} is not an event of this machine): every kept message would time out",
                f"Link {decl.by!r} at begin or at an event ('linked_at:'), or drop 'early:'.",
            )  # fmt: skip


def check_phases(spec: Spec) -> Iterable[Finding]:
    """KVF118: a phase spans live, declared states, and its deadline takes every one of them out of the phase."""
    for phase in spec.phases.values():
        where = f"phase {phase.name!r}"
        for name in spec.expand(phase.states):
            if name not in spec.states:
                declared = ", ".join(spec.live)
                yield _finding(
                    "KVF118", phase.loc, f"{where} names undeclared state {name!r}", f"Use one of: {declared}."
                )
            elif spec.states[name].is_final:
                yield _finding(
                    "KVF118", phase.loc, f"{where} spans final state {name!r}, but a finished request has nothing "
                    "left to wait for", f"Remove {name!r} from the phase's states.",
                )  # fmt: skip
        after, fire = phase.timeout.after, phase.timeout.fire
        if isinstance(after, str) and after not in spec.params:
            yield _finding(
                "KVF118", phase.timeout.loc, f"{where} times out after undeclared param {after!r}",
                f"Declare it under 'params:' (e.g. '{after}: 30.0') or write the seconds directly.",
            )  # fmt: skip
        inside = spec.phase_states[phase.name]
        for name in spec.expand(phase.states):
            if name not in spec.states or spec.states[name].is_final:
                continue
            edge = spec.table.get((name, fire))
            if edge is None:
                how = "only ignores" if (name, fire) in spec.ignores else "does not accept"
                yield _finding(
                    "KVF118", phase.timeout.loc, f"the deadline of {where} fires {fire!r}, which state {name!r} {how}: "
                    "the deadline could pass with the instance still there", f"Add a transition '{{event: {fire}, "
                    f"from: {name}, to: <a state outside the phase>}}', or fire an event every state of it accepts.",
                )  # fmt: skip
            elif edge.target in inside:
                yield _finding(
                    "KVF118", phase.timeout.loc, f"the deadline of {where} fires {fire!r}, which takes {name!r} to "
                    f"{edge.target!r}, inside the phase: a phase's deadline fires once per entry, so the instance "
                    "would then wait there with no deadline", f"Send {fire!r} from {name!r} out of the phase.",
                )  # fmt: skip


def check_owns(spec: Spec) -> Iterable[Finding]:
    """KVF119: the events the engine fires for a machine's children, and those it passes on, are its events."""
    events = {t.event for t in spec.transitions}
    fired: dict[str, str] = {}
    for owned in spec.owns.values():
        where = f"owns {owned.name!r}"
        for role, event in (("ended", owned.ended), ("failed", owned.failed)):
            if event is None:
                continue
            if event not in events:
                yield _finding(
                    "KVF119", owned.loc, f"{where} fires {event!r} ({role}), which no transition takes: "
                    f"the parent would never hear that its children {'ended' if role == 'ended' else 'failed'}",
                    f"Add a transition '{{event: {event}, from: <waiting state>, to: <next state>}}'.",
                )  # fmt: skip
            if event in fired:
                yield _finding(
                    "KVF119", owned.loc, f"{where} fires {event!r}, which {fired[event]} fires too",
                    "Give each its own event, so the parent can tell them apart.",
                )  # fmt: skip
            fired[event] = f"{where} ({role})"
        for event in owned.forward:
            if event not in events:
                yield _finding(
                    "KVF119", owned.loc, f"{where} passes {event!r} on to its children, but no transition of "
                    f"{spec.name!r} takes it, so it is never fired here", f"Remove {event!r} from 'forward:'.",
                )  # fmt: skip
            if event in (owned.ended, owned.failed):
                yield _finding(
                    "KVF119", owned.loc, f"{where} passes on {event!r}, the event its children's ends fire",
                    f"Remove {event!r} from 'forward:'.",
                )  # fmt: skip


def check_release_by(spec: Spec) -> Iterable[Finding]:
    """KVF120: a transition's own release action (``release:``) is for a resource it releases from every source,
    and is no resource's own release (which is called for that resource on every other edge)."""
    defaults = {r.release: r.name for r in spec.resources.values()}
    for t in spec.transitions:
        for resource, action in t.release:
            if resource not in spec.resources:
                declared = ", ".join(spec.resources) or "none"
                yield _finding(
                    "KVF120", t.loc, f"transition {t.event!r} releases undeclared resource {resource!r} by {action}()",
                    f"Name a resource declared under 'resources:' ({declared}).",
                )  # fmt: skip
                continue
            keeps = [src for src in spec.expand(t.sources) if src in spec.states and t.target in spec.states
                     and resource not in spec.releases(src, t.target)]  # fmt: skip
            if keeps:
                yield _finding(
                    "KVF120", t.loc, f"transition {t.event!r} names {action}() to release {resource!r}, but from "
                    f"{', '.join(map(repr, keeps))} it releases no {resource!r}: the action would never run there",
                    f"Drop it from 'release:', or narrow 'from:' to states that hold {resource!r} where "
                    f"{t.target!r} does not.",
                )  # fmt: skip
            if action in defaults and defaults[action] != resource:
                yield _finding(
                    "KVF120", t.loc, f"transition {t.event!r} releases {resource!r} by {action}(), which is also "
                    f"resource {defaults[action]!r}'s own release: it could not tell which is going",
                    f"Give it an action of its own, e.g. '{action}_{resource}'.",
                )  # fmt: skip


CHECKS: tuple[Check, ...] = (
    check_initial,
    check_references,
    check_reachable,
    check_can_finish,
    check_finals,
    check_deterministic,
    check_waiting,
    check_abortable,
    check_error_paths,
    check_ignore_overlap,
    check_release_actions,
    check_relations,
    check_id_spaces,
    check_outgoing,
    check_remote_events,
    check_counts,
    check_early,
    check_phases,
    check_owns,
    check_release_by,
)


def run_checks(spec: Spec) -> list[Finding]:
    """Every finding for a parsed spec, in file order."""
    findings = [f for check in CHECKS for f in check(spec)]
    return sorted(findings, key=lambda f: (f.line, f.col, f.code))
