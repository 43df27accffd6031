"""The one plain reading of ``owns:``: a parent machine, the child instances it owns, and what each side's calls do.

Independent of the engine's :mod:`kvfsm.engine.owners`, as
:mod:`~kvfsm.testing.oracle` is of the Tracker: two :class:`SpecModel`\\ s
(the parent's, the child's) joined by the rules the spec guide states, in
the order the engine applies them:

- a child's ``begin`` names its parent in the payload key ``by``; a parent
  with no instance, or one in a final state, refuses it (``UnknownParent``)
  and nothing begins;
- after a parent's transition (its releases done), in this order: an event
  in ``forward`` is fired on each live child (in ``repr`` order of their
  keys); entering a state that takes ``ended`` with no child live fires
  ``ended``; a final state forgets its children;
- a child that reaches a final state (or that ``close()`` releases by force)
  is no longer live; its parent gets ``failed`` (if declared) when it ended
  in a failure state, then ``ended`` if it was the last one live;
- ``ended`` and ``failed`` fire only if the parent's state has a transition
  on them then (``ended`` only while no child is live);
- a side that is in a call runs what the other side asks of it after its
  current step (after each key, for ``poll`` and ``close``); a side that is
  not runs it at once, inside the asking step, and what fails there is the
  asking call's failure.

Each public call returns one :class:`Outcome` holding everything it caused,
on both sides, in the order it happened.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from ..spec.model import Owned, Spec
from .oracle import Instance, Move, Outcome, SpecModel

Step = Callable[[Outcome], None]
"""A call one side runs later: it adds what it did to the Outcome of the call that runs it."""


class _Side:
    """One machine of the family: its model, whether it is in a call, and what waits for that call to end."""

    __slots__ = ("busy", "model", "queue")

    def __init__(self, model: SpecModel) -> None:
        self.model = model
        self.busy = False
        self.queue: deque[Step] = deque()


class FamilyModel(SpecModel):
    """The parent's :class:`SpecModel`, owning the instances of ``child`` its spec names under ``owns:``.

    The inherited calls (begin, fire, deliver, poll, close) are the parent's,
    with the family rules applied; :meth:`begin_child`, :meth:`fire_child`,
    :meth:`poll_child`, :meth:`close_child` and :meth:`drain_child` are the
    child tracker's. :attr:`child` is the child's own model, for its states.
    """

    def __init__(self, spec: Spec, child: Spec, params: Mapping[str, float] | None = None) -> None:
        super().__init__(spec, {k: v for k, v in (params or {}).items() if k in spec.params})
        rules = [o for o in spec.owns.values() if o.machine == child.name]
        if not rules:
            raise ValueError(f"machine {spec.name!r} does not own instances of {child.name!r}")
        self.rule: Owned = rules[0]
        self.child = SpecModel(child, {k: v for k, v in (params or {}).items() if k in child.params})
        self.children: dict[Hashable, set[Hashable]] = {}
        """Parent key → its children not yet in a final state (no entry: none)."""
        self.parent_of: dict[Hashable, Hashable] = {}
        """Live child key → its parent's key."""
        self._parent, self._child = _Side(self), _Side(self.child)
        self.on_move = self._parent_moved
        self.settle = self._settle_parent
        self.child.on_move = self._child_moved
        self.child.on_forced = self._child_forced
        self.child.settle = self._settle_child

    @property
    def now(self) -> float:
        """The one clock both trackers read: setting it sets the child's."""
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        self._now = value
        child = self.__dict__.get("child")
        if child is not None:
            child.now = value

    def _shared(self) -> tuple[object, ...]:
        return (*super()._shared(), *self.child._shared(), self.rule)

    # -- the parent tracker's calls ----------------------------------------------

    def begin(self, key: Hashable, payload: Mapping[str, Any] | None = None) -> Outcome:
        return self._as(self._parent, lambda: super(FamilyModel, self).begin(key, payload), key)

    def fire(self, key: Hashable, event: str, payload: Mapping[str, Any] | None = None) -> Outcome:
        return self._as(self._parent, lambda: super(FamilyModel, self).fire(key, event, payload), key)

    def poll(self, now: float | None = None) -> Outcome:
        return self._as(self._parent, lambda: super(FamilyModel, self).poll(now))

    def close(self) -> Outcome:
        return self._as(self._parent, super().close)

    # -- the child tracker's calls ----------------------------------------------

    def orphan(self, key: Hashable, payload: Mapping[str, Any]) -> Outcome | None:
        """The refusal of a child's begin that names no live parent under ``by`` (None: it names one, or the child's
        own checks refuse first: a closed tracker, a live key)."""
        child = self.child
        old = child.live.get(key)
        if child.closed or (old is not None and not child.spec.states[old.state].is_final):
            return None
        state = self.state(payload.get(self.rule.by))
        if state is None or self.spec.states[state].is_final:
            return Outcome(event="begin", refused="orphan", state=state)
        return None

    def begin_child(self, key: Hashable, payload: Mapping[str, Any]) -> Outcome:
        """``begin`` on the child tracker: refused as the child's own begin would be (closed, live key), else
        as an :meth:`orphan`; a child begun is its parent's."""
        child = self.child
        old = child.live.get(key)
        refused = self.orphan(key, payload)
        if refused is not None:
            return refused

        def begin() -> Outcome:
            out = child.begin(key, payload)
            if child.live.get(key) is not old and child.live.get(key) is not None:
                parent = payload[self.rule.by]
                self.children.setdefault(parent, set()).add(key)
                self.parent_of[key] = parent
            return out

        return self._as(self._child, begin, key)

    def fire_child(self, key: Hashable, event: str) -> Outcome:
        return self._as(self._child, lambda: self.child.fire(key, event), key)

    def poll_child(self, now: float | None = None) -> Outcome:
        return self._as(self._child, lambda: self.child.poll(now))

    def close_child(self) -> Outcome:
        return self._as(self._child, self.child.close)

    def drain_child(self) -> Outcome:
        return self.child.drain()

    # -- the rules ------------------------------------------------------------------

    def _as(self, side: _Side, call: Callable[[], Outcome], key: Hashable = None) -> Outcome:
        """Run ``call`` as that side's tracker call: what it queues runs after it, and a fire returns the state
        its key is in once all of that has run."""
        if side.busy:  # a nested call of the same side (deliver → fire): part of the running one
            return call()
        side.busy = True
        try:
            out = call()
            self._drain(side, out)
        finally:
            side.busy = False
        if key is not None and out.refused is None and out.event not in ("", "begin"):
            out.state = side.model.state(key)
        return out

    def _drain(self, side: _Side, out: Outcome) -> None:
        while side.queue:
            side.queue.popleft()(out)

    def _settle_parent(self, out: Outcome) -> None:
        self._drain(self._parent, out)

    def _settle_child(self, out: Outcome) -> None:
        self._drain(self._child, out)

    def _run(self, side: _Side, step: Step, out: Outcome) -> None:
        """Ask ``side`` to run ``step``: after its current call if it is in one, else now, as a call of its own."""
        if side.busy:
            side.queue.append(step)
            return
        side.busy = True
        try:
            step(out)
            self._drain(side, out)
        finally:
            side.busy = False

    def _parent_moved(self, inst: Instance, move: Move, out: Outcome) -> None:
        key, rule = move.key, self.rule
        if move.event in rule.forward and move.how != "begin":
            for child in sorted(self.children.get(key, ()), key=repr):
                self._run(self._child, self._forward(child, move.event), out)
        entered = (move.target, rule.ended) in self.edges and move.target != move.source
        if entered:
            self._run(self._parent, self._poke(key, rule.ended, idle=True), out)
        if self.spec.states[move.target].is_final:
            self.children.pop(key, None)

    def _forward(self, child: Hashable, event: str) -> Step:
        def step(out: Outcome) -> None:
            _merge(out, self.child.fire(child, event))

        return step

    def _poke(self, key: Hashable, event: str, idle: bool) -> Step:
        def step(out: Outcome) -> None:
            inst = self.live.get(key)
            if inst is None or (inst.state, event) not in self.edges or (idle and key in self.children):
                return
            _merge(out, SpecModel.fire(self, key, event))

        return step

    def _child_moved(self, inst: Instance, move: Move, out: Outcome) -> None:
        final = self.child.spec.states[move.target].final
        if final is not None and move.how != "begin":
            self._child_ended(move.key, final == "failure", out)

    def _child_forced(self, key: Hashable, out: Outcome) -> None:
        self._child_ended(key, True, out)

    def _child_ended(self, child: Hashable, failed: bool, out: Outcome) -> None:
        parent = self.parent_of.pop(child, None)
        if parent is None:
            return
        live = self.children.get(parent)
        if live is None:  # the parent ended first
            return
        live.discard(child)
        if not live:
            del self.children[parent]
        if failed and self.rule.failed is not None:
            self._run(self._parent, self._poke(parent, self.rule.failed, idle=False), out)
        if not live:
            self._run(self._parent, self._poke(parent, self.rule.ended, idle=True), out)


def _merge(out: Outcome, sub: Outcome) -> None:
    """What a nested call did, as part of the call that ran it."""
    out.moves += sub.moves
    out.calls += sub.calls
    out.failures += sub.failures
