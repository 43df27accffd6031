"""The composition checks (KVF201–KVF218): what a system file's roles, messages and properties get wrong together.

Each role's own findings come from the machine checks (:mod:`kvfsm.spec.checks`)
when the loader reads it; these look at what only the composition can show:
sends to undeclared messages or roles, messages no state handles, waits that
only a lossy message can end, states no run reaches, properties naming what
does not exist, remote events nobody is said to send.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Collection, Iterator

from ..findings import Finding, Severity
from ..model import ABORT, NOWHERE, Loc, Spec
from .model import CRASH, CRASHED, System


def _finding(code: str, loc: Loc, message: str, fix: str, severity: Severity = "error") -> Finding:
    return Finding(code, severity, loc.path, loc.line, message, fix, loc.col)


def _handled(spec: Spec) -> dict[str, set[str]]:
    """state → events with a transition from it."""
    out: dict[str, set[str]] = defaultdict(set)
    for e in spec.edges():
        out[e.source].add(e.event)
    return out


def _check_sends(system: System, missing: Collection[str]) -> Iterator[Finding]:
    """KVF201, KVF202: every send names a declared message, to the role that receives it, from its sender."""
    roles = ", ".join(system.roles)
    for role in system.roles.values():
        for t in role.spec.transitions:
            for send in t.sends:
                msg = system.messages.get(send.message)
                if msg is None:
                    yield _finding(
                        "KVF201",
                        send.loc,
                        f"{role.name}: transition {t.event!r} sends {send.message!r}, which {system.path} does not declare",
                        f"Declare it under 'messages:' as '{send.message}: {{from: {role.name}, to: {send.to}}}', or fix the name.",
                    )
                    continue
                if send.to in missing:
                    pass  # its spec could not be read: KVF200 or the role's own findings say so
                elif send.to not in system.roles:
                    yield _finding(
                        "KVF202",
                        send.loc,
                        f"{role.name}: transition {t.event!r} sends {send.message!r} to {send.to!r}, which is not a role",
                        f"Send it to one of: {roles}.",
                    )
                elif send.to != msg.receiver:
                    yield _finding(
                        "KVF202",
                        send.loc,
                        f"{role.name}: transition {t.event!r} sends {send.message!r} to {send.to!r}, but the message is declared to go to {msg.receiver!r}",
                        f"Write 'to: {msg.receiver}', or declare a separate message for {send.to!r}.",
                    )
                if msg.sender != role.name:
                    yield _finding(
                        "KVF202",
                        send.loc,
                        f"{role.name}: transition {t.event!r} sends {send.message!r}, which is declared to come from {msg.sender!r}",
                        f"Declare it 'from: {role.name}', or send it from {msg.sender!r}.",
                    )


def _check_messages(system: System, missing: Collection[str]) -> Iterator[Finding]:
    """KVF203, KVF204, KVF205, KVF210, KVF211, KVF212: declarations that cannot work as written."""
    sent = {s.message for r in system.roles.values() for t in r.spec.transitions for s in t.sends}
    roles = ", ".join(system.roles)
    for msg in system.messages.values():
        bad_ends = [r for r in (msg.sender, msg.receiver) if r not in system.roles and r not in missing]
        for r in bad_ends:
            yield _finding(
                "KVF211", msg.loc, f"message {msg.name!r} names {r!r}, which is not a role", f"Use one of: {roles}."
            )
        if msg.sender == msg.receiver:
            yield _finding(
                "KVF211",
                msg.loc,
                f"message {msg.name!r} goes from {msg.sender!r} to itself",
                "Messages cross between roles; a role's own next step is a local event.",
            )
        if msg.reply_if_finished is not None:
            reply = system.messages.get(msg.reply_if_finished)
            if reply is None or reply.sender != msg.receiver or reply.receiver != msg.sender:
                yield _finding(
                    "KVF210",
                    msg.loc,
                    f"message {msg.name!r} is answered with {msg.reply_if_finished!r}, which is not declared from {msg.receiver!r} to {msg.sender!r}",
                    f"Declare '{msg.reply_if_finished}: {{from: {msg.receiver}, to: {msg.sender}}}'.",
                )
        if msg.name not in sent and msg.sender not in missing:
            yield _finding(
                "KVF204",
                msg.loc,
                f"message {msg.name!r} is declared but no transition sends it",
                f"Add 'send: {{to: {msg.receiver}, message: {msg.name}}}' to a transition of {msg.sender!r}, or delete it.",
                "warning",
            )
        receiver = system.roles.get(msg.receiver)
        if receiver is None:
            continue
        spec = receiver.spec
        if msg.name in (ABORT, spec.on_error):
            yield _finding(
                "KVF212",
                msg.loc,
                f"message {msg.name!r} is {msg.receiver}'s {'abort' if msg.name == ABORT else 'on_error'} event, which must stay local",
                f"A message event happens only on delivery, so {msg.receiver} could no longer {msg.name} on its own; give the message its own name.",
            )
        handled = _handled(spec)
        ignored = {(st, ev) for st, ev, _r in spec.ignored()}
        takes = [st for st in spec.states if msg.name in handled.get(st, ())]
        if not takes:
            only_ignored = any(ev == msg.name for _st, ev in ignored)
            yield _finding(
                "KVF203",
                msg.loc,
                f"message {msg.name!r} goes to {msg.receiver!r}, which "
                + ("only ever ignores it: sending it has no effect" if only_ignored else "has no transition for it"),
                f"Add a transition on {msg.name!r} to {receiver.path}"
                + (
                    ""
                    if only_ignored
                    else " (message names are events of the receiving role), or send it to a role that handles it."
                ),
                "warning" if only_ignored else "error",
            )
            if not only_ignored:
                continue
        bare = [st for st in spec.states if msg.name not in handled.get(st, ()) and (st, msg.name) not in ignored]
        if bare:
            yield _finding(
                "KVF205",
                msg.loc,
                f"message {msg.name!r} to {msg.receiver!r} is neither handled nor ignored in {', '.join(bare)}: "
                "arriving there (late, duplicated or reordered) it raises IllegalTransition",
                f"Add '{{event: {msg.name}, in: [{', '.join(bare)}]}}' to the ignore rules of {receiver.path} if it is harmless there.",
                "warning",
            )


def _check_waits(system: System) -> Iterator[Finding]:
    """KVF206, KVF208: message events are remote, so a state left only by messages needs a deadline."""
    for role in system.roles.values():
        spec = role.spec
        inbox = system.inbox(role.name)
        handled = _handled(spec)
        env = system.environment(role.name)
        for phase in spec.phases.values():
            if phase.timeout.fire in inbox:
                yield _finding(
                    "KVF208",
                    phase.timeout.loc,
                    f"{role.name}: phase {phase.name!r} times out by firing {phase.timeout.fire!r}, which is a message "
                    f"from {inbox[phase.timeout.fire].sender!r}",
                    "A message event happens only when the message arrives; fire a local event such as 'expire'.",
                )
        for st in spec.states.values():
            if st.timeout is not None and st.timeout.fire in inbox:
                yield _finding(
                    "KVF208",
                    st.timeout.loc,
                    f"{role.name}: state {st.name!r} times out by firing {st.timeout.fire!r}, which is a message from {inbox[st.timeout.fire].sender!r}",
                    "A message event happens only when the message arrives; fire a local event such as 'expire'.",
                )
            if st.is_final or not st.waits_local:
                continue
            ways = handled.get(st.name, set()) - env
            if ways and ways <= set(inbox):
                senders = sorted({inbox[e].sender for e in ways})
                yield _finding(
                    "KVF206",
                    st.loc,
                    f"{role.name}: state {st.name!r} is 'waits: local', but only messages from {', '.join(senders)} move it on "
                    f"({', '.join(sorted(ways))}): a lost message would pin it there forever{' holding ' + ', '.join(st.holds) if st.holds else ''}",
                    "Replace 'waits: local' with 'timeout: {after: <param>, fire: <local event>}'.",
                )


def _reachable(system: System) -> dict[str, set[str]]:
    """Role states reachable in the composition when messages flow only if some reachable transition sends them."""
    reached = {name: {r.spec.initial.name} for name, r in system.roles.items() if _has_initial(r.spec)}
    sendable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, role in system.roles.items():
            if name not in reached:
                continue
            inbox = system.inbox(name)
            for e in role.spec.edges():
                if e.source not in reached[name] or e.target not in role.spec.states:
                    continue
                if e.event in inbox and e.event not in sendable:
                    continue
                if e.target not in reached[name]:
                    reached[name].add(e.target)
                    changed = True
                for send in e.transition.sends:
                    if send.message not in sendable:
                        sendable.add(send.message)
                        changed = True
                        reply = system.messages.get(send.message)
                        if reply is not None and reply.reply_if_finished is not None:
                            sendable.add(reply.reply_if_finished)
    return reached


def _has_initial(spec: Spec) -> bool:
    return any(s.initial for s in spec.states.values())


def _check_armed(system: System) -> Iterator[Finding]:
    """KVF207: states (and so their timeouts) no run of the composition can reach."""
    reached = _reachable(system)
    for name, role in system.roles.items():
        if name not in reached:
            continue
        for st in role.spec.states.values():
            if st.name in reached[name]:
                continue
            what = "its timeout is never armed" if st.timeout is not None else "it is dead weight"
            yield _finding(
                "KVF207",
                st.timeout.loc if st.timeout is not None else st.loc,
                f"{name}: state {st.name!r} cannot be reached in {system.name!r} (it is entered only on messages no reachable transition sends), so {what}",
                "Send the message that leads there, or drop the state from this role.",
                "warning",
            )


def _check_properties(system: System, missing: Collection[str]) -> Iterator[Finding]:
    """KVF209: properties name roles, states and resources that exist."""
    for prop in system.never:
        for cond in prop.when:
            role = system.roles.get(cond.role)
            if role is None:
                if cond.role not in missing:
                    yield _finding(
                        "KVF209",
                        cond.loc,
                        f"property {prop.name!r} names {cond.role!r}, which is not a role",
                        f"Use one of: {', '.join(system.roles)}.",
                    )
                continue
            spec = role.spec
            for st in cond.states:
                if st not in spec.states:
                    yield _finding(
                        "KVF209",
                        cond.loc,
                        f"property {prop.name!r}: {cond.role} has no state {st!r}",
                        f"Use one of: {', '.join(spec.states)}.",
                    )
            for res in (*cond.holds, *cond.lacks):
                if res not in spec.resources:
                    yield _finding(
                        "KVF209",
                        cond.loc,
                        f"property {prop.name!r}: {cond.role} has no resource {res!r}",
                        f"Use one of: {', '.join(spec.resources) or '(it declares none)'}.",
                    )


def _check_relations(system: System, missing: Collection[str]) -> Iterator[Finding]:
    """KVF213: relations name roles and params that exist, and some timing can keep them all."""
    for rel in system.relations:
        for role_name, param in (rel.longer, *rel.shorter):
            role = system.roles.get(role_name)
            if role is None:
                if role_name not in missing:
                    yield _finding(
                        "KVF213",
                        rel.loc,
                        f"relation {rel.text!r} names {role_name!r}, which is not a role",
                        f"Use one of: {', '.join(system.roles)}.",
                    )
                continue
            timed = {t.after for st in role.spec.states for t in role.spec.timeouts(st)}
            if param not in timed:
                yield _finding(
                    "KVF213",
                    rel.loc,
                    f"relation {rel.text!r}: no state or phase of {role_name} has a timeout after {param!r}",
                    f"Name a param one of its timeouts uses: {', '.join(sorted(map(str, timed))) or '(it has none)'}.",
                )
    for role_name, param in system.timing.cycles():
        loc = next((r.loc for r in system.relations if r.longer == (role_name, param)), NOWHERE)
        yield _finding(
            "KVF213",
            loc,
            f"the relations make {role_name}.{param} longer than itself",
            "Relations must order the timeouts without a cycle; drop or turn around one of them.",
        )


def _check_crashes(system: System) -> Iterator[Finding]:
    """KVF214: a role that may crash has no state or event of its own by the names a crash uses."""
    for role in system.roles.values():
        if not role.crash:
            continue
        clash = [f"state {CRASHED!r}"] * (CRASHED in role.spec.states) + [f"event {CRASH!r}"] * (
            CRASH in role.spec.events
        )
        if clash:
            yield _finding(
                "KVF214",
                role.loc,
                f"role {role.name!r} may crash, but its spec has its own {' and '.join(clash)}",
                f"Rename them in {role.path}: a crash is the event {CRASH!r} into the state {CRASHED!r}.",
            )


def _check_counts(system: System) -> Iterator[Finding]:
    """KVF215: a message counted to K comes from a role with at least K ranks, or its transition never fires."""
    for msg in system.messages.values():
        sender = system.roles.get(msg.sender)
        if sender is not None and msg.count > sender.ranks:
            yield _finding(
                "KVF215",
                msg.loc,
                f"message {msg.name!r} is counted to {msg.count}, but {msg.sender!r} has {sender.ranks} rank(s):"
                f" {msg.receiver} would wait forever",
                f"Write 'count: all', or give {msg.sender!r} 'ranks: {msg.count}'.",
            )


def _check_remote(system: System) -> Iterator[Finding]:
    """KVF217: a remote event comes from a role (a declared message) or from outside (``environment:``).

    Without either, nothing says when it may happen: explored as the role's own
    work it would fire at any moment, and a fair run would even owe it.
    """
    for role in system.roles.values():
        for event in system.undelivered(role.name):
            decl = role.spec.event_decls[event]
            senders = [
                r.name
                for r in system.roles.values()
                if r.name != role.name
                and any(o.event == event and o.to == role.spec.name for o in r.spec.outgoing.values())
            ]
            sender = senders[0] if senders else "<sending role>"
            yield _finding(
                "KVF217",
                role.loc,
                f"role {role.name!r}: event {event!r} is 'remote: true' ({role.path} line {decl.loc.line}), but no "
                f"message of {system.name!r} delivers it and the role does not declare it the environment's: "
                f"the explorer cannot tell when it may happen",
                f"If a role of this system sends it, declare it under 'messages:' as "
                f"'{event}: {{from: {sender}, to: {role.name}}}' (and 'send:' it from that role's transition); if it "
                f"comes from outside the system, write 'environment: [{event}]' on role {role.name!r}: it may then "
                "happen whenever its state allows, and no fair run owes it.",
            )


def _check_environment(system: System) -> Iterator[Finding]:
    """KVF218: ``environment:`` names events of the role that are no message."""
    for role in system.roles.values():
        spec = role.spec
        inbox = system.inbox(role.name)
        known = set(spec.events)
        for event in role.environment:
            if event in inbox:
                yield _finding(
                    "KVF218",
                    role.loc,
                    f"role {role.name!r}: {event!r} is declared the environment's, but it is a message from "
                    f"{inbox[event].sender!r}: it happens when that message is delivered",
                    f"Drop {event!r} from 'environment:', or drop the message if the event really comes from outside.",
                )
            elif event not in known:
                close = difflib.get_close_matches(event, sorted(known), n=1)
                yield _finding(
                    "KVF218",
                    role.loc,
                    f"role {role.name!r}: 'environment:' names {event!r}, which is no event of {role.path}",
                    f"Did you mean {close[0]!r}?" if close else f"Name one of: {', '.join(sorted(known))}.",
                )


def run_system_checks(system: System, missing: Collection[str] = ()) -> list[Finding]:
    """Every composition finding (KVF201–KVF218), grouped by file, in line order within each.

    ``missing`` names roles whose spec could not be read: what they would
    have checked is left to the findings that say why.
    """
    found: list[Finding] = [
        *_check_sends(system, missing),
        *_check_messages(system, missing),
        *_check_waits(system),
        *_check_properties(system, missing),
        *_check_relations(system, missing),
        *_check_crashes(system),
        *_check_counts(system),
        *_check_remote(system),
        *_check_environment(system),
    ]
    if not missing and not any(f.severity == "error" for f in found):
        found += _check_armed(system)  # after an error, what it cuts off would only echo it
    return sorted(found, key=lambda f: (f.path != system.path, f.path, f.line, f.col, f.code))
