"""Compile a spec and a driver into flat runtime tables, once, before any instance exists.

Each state becomes a :class:`CState` whose ``row`` maps an event name straight
to a :class:`CEdge` holding everything a transition needs: the bound ``do``
method, the bound acquire and release methods the spec derives for that edge,
the target and its deadline. ``fire()`` then costs one dict lookup and a walk
over short tuples; nothing on the per-event path looks at the spec again.
"""

from __future__ import annotations

import dataclasses
import inspect
import reprlib
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..errors import BindingError, KvfsmError
from ..spec import well_formed
from ..spec.model import Edge, Spec, Transition

Action = Callable[..., Any]


class CState:
    """A state in runtime form. ``row[event]`` is a CEdge, or None for an event the state ignores."""

    __slots__ = ("after", "error_edge", "final", "holds", "index", "name", "row", "timeout_event")

    def __init__(self, name: str, index: int, final: bool, holds: tuple[str, ...]) -> None:
        self.name = name
        self.index = index
        self.row: dict[str, CEdge | None] = {}
        self.final = final
        self.holds = holds
        self.after: float | None = None
        self.timeout_event: str | None = None
        self.error_edge: CEdge | None = None

    def __repr__(self) -> str:
        return f"<state {self.name}>"


class CEdge:
    """One (source, event) → target step with its bound actions.

    ``acquires`` holds (acquire name, acquire, release name, release-to-undo)
    and ``releases`` (release name, release), in the spec's holds order;
    ``acquire_fns`` and ``release_fns`` are the same callables alone, which is
    all the per-event loops read (names are looked up only when one raises).
    """

    __slots__ = (
        "acquire_fns", "acquires", "bare", "batch_acquires", "batch_before", "batch_releases", "before", "count", "do",
        "do_name", "event", "links", "release_fns", "releases", "source", "target",
    )  # fmt: skip

    def __init__(
        self,
        event: str,
        source: CState | None,
        target: CState,
        do: Action | None,
        do_name: str | None,
        acquires: tuple[tuple[str, Action, str, Action], ...],
        releases: tuple[tuple[str, Action], ...],
    ) -> None:
        self.event = event
        self.links: tuple[str, ...] = ()
        """Id spaces whose id this edge's payload carries (``spaces: {name: {linked_at: event}}``), linked on it."""
        self.count: Count | None = None
        """How many distinct senders this edge waits for (``count:``); None: every arrival takes it."""
        self.source = source
        self.target = target
        self.do = per_key(do) if do is not None else None
        self.do_name = do_name
        self.batch_acquires = tuple(per_batch(acquire[1]) for acquire in acquires)
        self.batch_before = (per_batch(do), *self.batch_acquires) if do is not None else self.batch_acquires
        self.batch_releases = tuple(per_batch(fn) for _name, fn in releases)
        """The same actions called once per batch of keys (see :func:`batch`): what ``fire_many`` runs; position
        i of ``batch_before`` and ``batch_releases`` is position i of ``before`` and ``release_fns``."""
        self.acquires = tuple((a, per_key(fn), r, per_key(undo)) for a, fn, r, undo in acquires)
        self.releases = tuple((name, per_key(fn)) for name, fn in releases)
        self.acquire_fns = tuple(acquire[1] for acquire in self.acquires)
        self.before = _distinct((self.do, *self.acquire_fns) if self.do is not None else self.acquire_fns)
        """What runs before the state changes, in order (the do, then the acquires): ``fire``'s first loop.
        Each is a distinct object, so that the one that raised is known by identity."""
        self.release_fns = tuple(fn for _name, fn in self.releases)
        self.bare = self if not self.before else CEdge(event, source, target, None, None, (), self.releases)
        """This edge without the actions that can raise: how on_error is taken when its own action fails."""

    def add_tap(self, tap: Callable[[Hashable], object]) -> None:
        """Call ``tap(key)`` after this edge's releases (and its on_error twin's): see :meth:`Tracker.tap`."""
        for edge in {self, self.bare}:
            edge.release_fns += (tap,)
            edge.batch_releases += (per_batch(tap),)

    def __repr__(self) -> str:
        src = self.source.name if self.source else "∅"
        return f"<edge {src} -{self.event}-> {self.target.name}>"


class Count:
    """How many distinct senders a counted edge waits for during one stay in its source state.

    ``kind`` says where K comes from: ``"number"`` (``value``: written in the
    spec, or a param resolved at binding), ``"begin"`` (the instance's
    ``begin`` payload key ``name``, kept per instance) or ``"event"`` (the
    arrival's own payload key ``name``: each arrival says how many).
    """

    __slots__ = ("kind", "name", "value")

    def __init__(self, kind: str, name: str = "", value: int = 0) -> None:
        self.kind, self.name, self.value = kind, name, value

    @property
    def at_entry(self) -> bool:
        """Whether K is known as the instance enters the state (so K = 0 fires the edge at once)."""
        return self.kind != "event"

    def __repr__(self) -> str:
        return f"<count {self.kind} {self.name or self.value}>"


SENDER = "sender"
"""The keyword that names who sent a counted event: ``fire(key, event, sender=...)``; never passed to actions."""


def whole(value: object) -> int | None:
    """``value`` as a count of senders (an int, or a float with no fraction, at least 0); None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _distinct(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    """``actions`` with any repeated object wrapped in a ``partial`` (the same callable as do and acquire)."""
    seen: set[int] = set()
    out = []
    for action in actions:
        if id(action) in seen:
            action = partial(action)
        seen.add(id(action))
        out.append(action)
    return tuple(out)


Failed = Mapping[Hashable, BaseException]
"""What a batch action returns: the keys it failed for, each with its error (None or empty: none failed)."""

BATCH_MARK = "__kvfsm_batch__"


class BatchResultError(KvfsmError, TypeError):
    """A batch action returned something other than None or a mapping of keys it was called with to exceptions.

    The engine cannot tell which keys such an answer meant, so it stands for
    the whole group, as if the action had raised it: the failure names the
    action and what was wrong with what it returned.
    """


def batch(method: Callable[..., Failed | None]) -> Callable[..., Failed | None]:
    """Mark a driver action as taking a list of keys: ``fire_many`` calls it once per batch.

    The action is called as ``method(keys, **payload)`` (a release as
    ``method(keys)``) and returns the keys it failed for, each with its
    error (an exception instance), or None; raising fails every key of the
    batch, and so does returning anything else (a :class:`BatchResultError`
    then says what was wrong). ``fire`` calls it with a one-key list. A batch
    action suits an API that is batched already (Mooncake's
    ``batch_put_from``, vLLM's sets of finished requests).
    """
    setattr(method, BATCH_MARK, True)
    return method


def is_batch(action: Action) -> bool:
    return bool(getattr(action, BATCH_MARK, False))


def checked(result: object, keys: list[Hashable], action: str) -> dict[Hashable, BaseException]:
    """The failures a batch action called with ``keys`` reported, held to its contract (``result`` is not None).

    Returns each failed key of ``keys``, in their order, with its error. A
    result that is not a mapping, names a key the action was not called with
    or gives something other than an exception instance fails every key with
    one :class:`BatchResultError` saying so: an answer the engine cannot
    read must not move an instance outside the group, nor lose the failure.
    """
    if type(result) is dict and not result:
        return result
    problem = None
    if not isinstance(result, Mapping):
        problem = f"a {type(result).__name__}, not a mapping of the keys it failed for to their exceptions (or None)"
    else:
        try:
            failed = {key: result[key] for key in keys if key in result}
            strangers = [key for key in result if key not in failed] if len(failed) != len(result) else []
        except Exception as exc:  # a mapping that cannot be read, or an unhashable key in it
            problem = f"a {type(result).__name__} that could not be read ({type(exc).__name__}: {exc})"
        else:
            if strangers:
                problem = f"failures for {_few(strangers)}, which it was not called with"
            else:
                wrong = [(key, error) for key, error in failed.items() if not isinstance(error, BaseException)]
                if not wrong:
                    return failed
                key, error = wrong[0]
                problem = f"{_short(error)} for {key!r}, which is not an exception instance"
    error = BatchResultError(
        f"{action}() was called with {_few(keys)} and returned {problem}; the whole group is taken as failed"
    )
    return dict.fromkeys(keys, error)


def _short(value: object) -> str:
    return reprlib.repr(value)


def _few(keys: list[Hashable]) -> str:
    shown = ", ".join(map(_short, keys[:3]))
    return f"{len(keys)} keys ({shown}, …)" if len(keys) > 3 else f"[{shown}]"


def per_key(action: Action) -> Action:
    """``action`` as ``fire`` calls it: with one key (a batch action gets a one-key list, and its failure raises)."""
    if not is_batch(action):
        return action
    name = getattr(action, "__name__", "batch_action")

    def one(key: Hashable, /, **payload: Any) -> None:
        failed = action([key], **payload)
        if failed is not None:
            failed = checked(failed, [key], name)
            if failed:
                raise failed[key]

    one.__name__ = name
    return one


def per_batch(action: Action) -> Callable[..., Failed | None]:
    """``action`` as ``fire_many`` calls it: with a list of keys (a per-key action is called for each)."""
    if is_batch(action):
        return action

    def each(keys: list[Hashable], /, **payload: Any) -> Failed | None:
        failed: dict[Hashable, BaseException] = {}
        for key in keys:
            try:
                action(key, **payload) if payload else action(key)
            except BaseException as exc:
                failed[key] = exc
        return failed or None

    return each


@dataclass(frozen=True)
class Program:
    spec: Spec
    states: tuple[CState, ...]
    by_name: Mapping[str, CState]
    begin: CEdge
    """Pseudo-edge entering the initial state: its acquires run at ``begin``. Its
    ``releases`` are the initial resources with no acquire action: held from the
    moment ``begin`` is called, so released if an acquire of ``begin`` fails."""

    def edges(self) -> list[CEdge]:
        """Every compiled transition (not the begin pseudo-edge), each once."""
        return [edge for state in self.states for edge in state.row.values() if edge is not None]

    payloads: Mapping[str, frozenset[str]]
    """Event → the payload keys ``fire`` accepts for it (``sender`` for a counted event); ``begin`` is
    :attr:`begin_payload`."""
    begin_payload: frozenset[str]
    releases: Mapping[str, tuple[str, Action]]
    """Resource → (its release action's name, the action as ``fire`` calls it, with one key): what ``close()``
    calls when it must release an instance by force (a batch release then gets a one-key list)."""
    begin_counts: frozenset[str] = frozenset()
    """``begin`` payload keys that give a count's K: each must be a whole number, kept per instance."""
    entry_counts: Mapping[str, tuple[tuple[str, Count], ...]] = dataclasses.field(default_factory=dict)
    """State → its counted edges whose K is known on entry ((event, count)): K = 0 fires the event at once."""


def _bind(driver: object, name: str, missing: list[str]) -> Action:
    method = getattr(driver, name, None)
    if not callable(method):
        missing.append(name)
        return _missing
    return method  # type: ignore[no-any-return]


def _signature_problems(name: str, method: Action, carried: Mapping[str, frozenset[str]]) -> list[str]:
    """What makes ``method(key, **payload)`` fail for some event that calls it.

    ``carried`` maps each event that calls the method to the payload keys the
    spec declares for it (empty for a release: releases get the key alone).
    A method whose signature cannot be read (a builtin) is trusted.
    """
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or (params[0].kind not in positional and params[0].kind is not inspect.Parameter.VAR_POSITIONAL):
        return [f"{name}() must take the key as its first positional parameter"]
    rest = params[1:] if params[0].kind in positional else params
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in rest)
    keywords = {
        p.name for p in rest if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    required = {p.name for p in rest if p.default is inspect.Parameter.empty and p.name in keywords}
    required |= {p.name for p in rest if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty}
    problems = []
    for event, names in carried.items():
        unknown = sorted(names - keywords) if not takes_any else []
        if unknown:
            problems.append(
                f"{name}() is called on {event!r} with payload {', '.join(unknown)}, which it does not take"
            )
        lacking = sorted(required - names)
        if lacking:
            what = f"on {event!r}" if event != RELEASE else "as a release, with the key alone"
            fix = (
                "declare it with 'payload: [...]' on the transition, or give it a default"
                if event != RELEASE
                else "give it a default, or keep what the release needs in the driver, by key"
            )
            problems.append(f"{name}() requires {', '.join(lacking)}, but is called {what} without it ({fix})")
    return problems


RELEASE = "<release>"
"""How :func:`_signature_problems` names the call of a release action: with the key only."""


def _missing(*_a: object, **_k: object) -> None:  # pragma: no cover - never called: binding fails first
    raise AssertionError


def _driver_problems(spec: Spec, driver: object) -> list[str]:
    """Signature mismatches between the driver's actions and the payload the spec says each receives."""
    carried: dict[str, dict[str, frozenset[str]]] = {}
    for resource in spec.resources.values():
        carried.setdefault(resource.release, {})[RELEASE] = frozenset()
    for t in spec.transitions:
        for _r, action in t.release:
            carried.setdefault(action, {})[RELEASE] = frozenset()
    for e in spec.edges():
        for action in spec.raising_actions(e):
            carried.setdefault(action, {})[e.event] = spec.payloads.get(e.event, frozenset())
    for r in spec.acquires(None, spec.initial.name):
        acquire = spec.resources[r].acquire
        if acquire:
            carried.setdefault(acquire, {})["begin"] = frozenset(spec.begin_payload)
    problems: list[str] = []
    for name in sorted(carried):
        problems += _signature_problems(name, getattr(driver, name), carried[name])
    return problems


def compile_program(spec: Spec, driver: object, params: Mapping[str, float] | None = None) -> Program:
    """Bind ``driver``'s methods to ``spec``; raises :class:`BindingError` naming every gap.

    ``spec`` must be well formed (:func:`kvfsm.spec.well_formed`, else
    :class:`SpecError`): the tables below take that for granted.
    """
    well_formed(spec)
    params = dict(params or {})
    problems = spec.param_problems(params)
    if problems:
        raise BindingError("; ".join(problems))
    broken = spec.broken_relations(params)
    if broken:
        values = {**spec.params, **params}
        raise BindingError(
            "; ".join(f"params break relation {r.text!r} declared at {r.loc} ({r.given(values)})" for r in broken)
        )
    missing: list[str] = []
    release = {r.name: _bind(driver, r.release, missing) for r in spec.resources.values()}
    acquire = {r.name: _bind(driver, r.acquire, missing) for r in spec.resources.values() if r.acquire}
    do = {t.do: _bind(driver, t.do, missing) for t in spec.transitions if t.do}
    own = {a: _bind(driver, a, missing) for t in spec.transitions for _r, a in t.release}
    """Release actions a transition names for a resource instead of its own (``release:``)."""
    if missing:
        names = ", ".join(sorted(set(missing)))
        raise BindingError(
            f"driver {type(driver).__name__} lacks method(s) {names} that machine {spec.name!r} ({spec.path}) names; "
            "each do/acquire is called as method(key, **payload) and each release as method(key)"
        )
    problems = _driver_problems(spec, driver)
    if problems:
        raise BindingError(
            f"driver {type(driver).__name__} does not fit machine {spec.name!r} ({spec.path}): " + "; ".join(problems)
        )

    states = tuple(CState(s.name, i, s.is_final, s.holds) for i, s in enumerate(spec.states.values()))
    by_name = {s.name: s for s in states}

    def edge(event: str, source: str | None, target: str, do_name: str | None, spec_edge: Edge | None = None) -> CEdge:
        acq = tuple(
            (spec.resources[r].acquire or "", acquire[r], spec.resources[r].release, release[r])
            for r in spec.acquires(source, target)
            if r in acquire
        )
        if spec_edge is not None:
            rel = tuple((name, own.get(name) or release[r]) for r, name in spec.release_actions(spec_edge))
        else:  # begin: what is held without an acquire action, released only if begin fails
            rel = tuple((spec.resources[r].release, release[r]) for r in spec.holds(target) if r not in acquire)
        return CEdge(
            event,
            by_name[source] if source else None,
            by_name[target],
            do[do_name] if do_name else None,
            do_name,
            acq,
            rel,
        )

    for (source, event), e in spec.table.items():
        by_name[source].row[event] = compiled = edge(event, source, e.target, e.do, e)
        compiled.links = compiled.bare.links = spec.linked_at(event)
        compiled.count = _count(spec, e.transition, params)
    for state_name, event, _rule in spec.ignored():  # in declaration order, so messages list events stably
        by_name[state_name].row.setdefault(event, None)
    for s in spec.states.values():
        cs = by_name[s.name]
        if s.timeout is not None:
            cs.after = spec.param(s.timeout.after, params)
            cs.timeout_event = s.timeout.fire
        if spec.on_error is not None:
            handler = cs.row.get(spec.on_error)
            cs.error_edge = handler
    initial = spec.initial.name
    begin = edge("begin", None, initial, None)
    begin.links = spec.linked_at("begin")
    releases = {r: (spec.resources[r].release, per_key(fn)) for r, fn in release.items()}
    payloads = dict(spec.payloads)
    entry: dict[str, list[tuple[str, Count]]] = {}
    begin_counts = set()
    for cs in states:
        for event, ce in cs.row.items():
            if ce is None or ce.count is None:
                continue
            payloads[event] = payloads.get(event, frozenset()) | {SENDER}
            if ce.count.at_entry:
                entry.setdefault(cs.name, []).append((event, ce.count))
            if ce.count.kind == "begin":
                begin_counts.add(ce.count.name)
    return Program(
        spec, states, by_name, begin, payloads, frozenset(spec.begin_payload), releases,
        frozenset(begin_counts), {name: tuple(counts) for name, counts in entry.items()},
    )  # fmt: skip


def _count(spec: Spec, transition: Transition, params: Mapping[str, float]) -> Count | None:
    """The compiled ``count:`` of a transition (a param's value as bound); raises BindingError for a bad param."""
    source = spec.count_source(transition)
    if source is None:
        return None
    kind, what = source
    if kind == "number":
        return Count("number", value=int(what))
    if kind == "param":
        value = whole(spec.param(str(what), params))
        if value is None:
            raise BindingError(
                f"param {what!r} of machine {spec.name!r} is the count of {transition.event!r}: it must be a whole "
                f"number of senders (0 or more), not {spec.param(str(what), params)!r}"
            )
        return Count("number", str(what), value)
    return Count(kind, str(what))
