"""Which timeouts may fire, given the system's relations and which deadlines were armed before which.

A role's instance has deadline *slots*: its state's own timeout, and one per
phase of its spec (:class:`~kvfsm.spec.model.Phase`). The abstraction is an
*ordered deadline set*, kept as one bit per ordered pair of slots (a, b)
where some deadline of b is declared longer than some deadline of a: the bit
says that a is armed, b too, and a was armed no later than b. Then b's
timeout may not fire while the bit is set and a's armed deadline is declared
shorter than b's: a (armed at t_a ≤ t_b, shorter) falls due first, and its
instance must leave a's states before b falls due.

It is sound: every timed run, for any durations that keep the relations,
orders its expiries this way, so it is one of the runs explored; runs the
bits forbid cannot happen. It is coarse where zones would be exact: a sum
``a > b + c`` is used through its consequences ``a > b`` and ``a > c``, and
what elapsed between two armings is forgotten. Without relations no pair
exists and every timeout may fire at any time, as before.

Arming follows the Tracker:

- a state's own slot: every fired transition into a state with a timeout
  arms it afresh (a self-loop too), leaving the state disarms it;
- a phase's slot: entering any of the phase's states from outside it arms it
  (``begin`` too), moving among its states or taking a self-loop keeps it as
  it is, leaving the phase disarms it. It fires once per entry: KVF118 makes
  its firing leave the phase, so in a clean spec a phase slot is armed exactly
  while the instance is in one of the phase's states;
- ignoring, answering, counting or rejecting a message changes nothing.

Which slots are armed is therefore a function of the instance's state; only
*when* each was armed needs the bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..spec.system import System

Param = tuple[str, str]
"""(declared role, the ``after`` of a deadline, as a relation names it)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One deadline of one role: its state's own (``phase`` empty) or a phase's."""

    role: int
    phase: str
    """The phase's name; empty for the state's own timeout."""
    param: tuple[Param | None, ...]
    """Per state (by index): the deadline's param if the slot is armed there, else None."""
    fire: tuple[str | None, ...]
    """Per state (by index): the event the slot fires there (None where it is not armed)."""


class Clocks:
    """The pair bits of one request: their start, whether a timeout may fire, and what a fired transition does."""

    def __init__(self, system: System, states: Sequence[Sequence[str]]) -> None:
        timing = system.timing
        names = list(system.roles)
        self.slots: list[Slot] = []
        self.of_role: list[tuple[int, ...]] = []
        """Per role: its slots (indices into :attr:`slots`), the state's own first, then each phase's."""
        for r, (name, order) in enumerate(zip(names, states, strict=True)):
            spec = system.roles[name].spec
            base = system.base_of(name)  # relations name declared roles; every rank's deadline is as long
            own = [spec.states[s].timeout if s in spec.states else None for s in order]
            mine = [len(self.slots)]
            self.slots.append(
                Slot(
                    r,
                    "",
                    tuple((base, str(t.after)) if t is not None else None for t in own),
                    tuple(t.fire if t is not None else None for t in own),
                )
            )
            for phase in spec.phases.values():
                inside = [s in spec.phase_states[phase.name] and s in spec.states for s in order]
                mine.append(len(self.slots))
                self.slots.append(
                    Slot(
                        r,
                        phase.name,
                        tuple((base, str(phase.timeout.after)) if x else None for x in inside),
                        tuple(phase.timeout.fire if x else None for x in inside),
                    )
                )
            self.of_role.append(tuple(mine))
        timed = [{p for p in slot.param if p is not None} for slot in self.slots]
        n = len(self.slots)
        self.pairs: list[tuple[int, int]] = [
            (a, b)
            for b in range(n)
            for a in range(n)
            if a != b and any(timing.outlasts(pb, pa) for pb in timed[b] for pa in timed[a])
        ]
        """(a, b) per bit: b's deadline may be declared longer than a's."""
        self.timing = timing
        self.shorter = [[(a, 1 << k) for k, (a, x) in enumerate(self.pairs) if x == b] for b in range(n)]
        """per slot b: (a, bit) for the pairs in which b is the longer one."""
        self.touching = [sum(1 << k for k, (a, x) in enumerate(self.pairs) if s in (a, x)) for s in range(n)]

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def armed(self, slot: int, at: Sequence[int]) -> Param | None:
        """The param of ``slot``'s deadline if it is armed with the roles in ``at``, else None."""
        s = self.slots[slot]
        return s.param[at[s.role]]

    def initial(self, at: Sequence[int]) -> int:
        """At begin every initial deadline is armed at the same instant: each is armed no later than the others."""
        return sum(
            1 << k
            for k, (a, b) in enumerate(self.pairs)
            if self.armed(a, at) is not None and self.armed(b, at) is not None
        )

    def held_back(self, bits: int, at: Sequence[int], slot: int) -> bool:
        """Whether ``slot``'s deadline may not fall due yet: a shorter one armed no later is still armed."""
        mine = self.armed(slot, at)
        if mine is None:
            return False
        for a, bit in self.shorter[slot]:
            if bits & bit:
                other = self.armed(a, at)
                if other is not None and self.timing.outlasts(mine, other):
                    return True
        return False

    def blocked(self, bits: int, at: Sequence[int], r: int, event: str) -> bool:
        """Whether role r's timeout ``event`` may not fire yet: every armed deadline of r that fires it is held back
        (False where none of r's armed deadlines fires ``event``: then it is no timeout)."""
        s = at[r]
        firing = [k for k in self.of_role[r] if self.slots[k].fire[s] == event]
        return bool(firing) and all(self.held_back(bits, at, k) for k in firing)

    def moved(self, r: int, source: int | None, target: int) -> tuple[list[int], list[int]]:
        """(armed afresh, disarmed): role r's slots that a fired transition ``source`` → ``target`` arms and
        disarms (``None`` source: from no state). A phase slot the move stays in is in neither; a state's own
        slot is armed afresh on every entry, a self-loop's too."""
        fresh, gone = [], []
        for k in self.of_role[r]:
            slot = self.slots[k]
            if slot.param[target] is None:
                gone.append(k)
            elif not slot.phase or source is None or slot.param[source] is None:
                fresh.append(k)
        return fresh, gone

    def fired(self, bits: int, r: int, source: int, at: Sequence[int]) -> int:
        """The bits after role r fired a transition from state ``source``, leaving the roles in ``at``: each of r's
        deadlines armed afresh, kept (a phase it stays in) or gone."""
        fresh, gone = self.moved(r, source, at[r])
        for k in (*fresh, *gone):
            bits &= ~self.touching[k]
        for b in fresh:
            for a, bit in self.shorter[b]:
                if self.armed(a, at) is not None:
                    bits |= bit  # a was armed before b (or with it), and b is armed now
        return bits
