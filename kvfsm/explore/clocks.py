"""Which timeouts may fire, given the system's relations and which deadlines were armed before which.

The abstraction is an *ordered deadline set*, kept as one bit per ordered
pair of roles (e, r) where some timeout of r is declared longer than some
timeout of e: the bit says that e's deadline is armed, r's too, and e's was
armed no later than r's. Then r's timeout may not fire while the bit is set
and e's armed timeout is declared shorter than r's: e's deadline (armed at
t_e ≤ t_r, shorter) falls due first, and e must leave the state before it.

It is sound: every timed run, for any durations that keep the relations,
orders its expiries this way, so it is one of the runs explored; runs the
bits forbid cannot happen. It is coarse where zones would be exact: a sum
``a > b + c`` is used through its consequences ``a > b`` and ``a > c``, and
what elapsed between two armings is forgotten. Without relations no pair
exists and every timeout may fire at any time, as before.

Arming follows the Tracker: every fired transition into a state with a
timeout arms it afresh (a self-loop too), leaving the state disarms it;
ignoring, answering or rejecting a message changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..spec.system import System


class Clocks:
    """The pair bits of one request: their start, whether a timeout may fire, and what a fired transition does."""

    def __init__(self, system: System, states: Sequence[Sequence[str]]) -> None:
        timing = system.timing
        names = list(system.roles)
        self.param: list[list[tuple[str, str] | None]] = []
        for name, order in zip(names, states, strict=True):
            spec = system.roles[name].spec
            base = system.base_of(name)  # relations name declared roles; every rank's deadline is as long
            self.param.append(
                [
                    (base, str(t.after)) if s in spec.states and (t := spec.states[s].timeout) is not None else None
                    for s in order
                ]
            )
        timed = [{p for p in row if p is not None} for row in self.param]
        self.pairs: list[tuple[int, int]] = [
            (e, r)
            for r in range(len(names))
            for e in range(len(names))
            if e != r and any(timing.outlasts(pr, pe) for pr in timed[r] for pe in timed[e])
        ]
        self.timing = timing
        self.shorter = [[(e, 1 << k) for k, (e, x) in enumerate(self.pairs) if x == r] for r in range(len(names))]
        """per role r: (e, bit) for the pairs in which r is the longer one."""
        self.touching = [sum(1 << k for k, (e, x) in enumerate(self.pairs) if r in (e, x)) for r in range(len(names))]

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def initial(self, at: Sequence[int]) -> int:
        """At begin every initial deadline is armed at the same instant: each is armed no later than the others."""
        return sum(
            1 << k
            for k, (e, r) in enumerate(self.pairs)
            if self.param[e][at[e]] is not None and self.param[r][at[r]] is not None
        )

    def blocked(self, bits: int, at: Sequence[int], r: int) -> bool:
        """Whether r's timeout may not fire yet: a shorter deadline armed no later than r's is still armed."""
        mine = self.param[r][at[r]]
        if mine is None:
            return False
        for e, bit in self.shorter[r]:
            other = self.param[e][at[e]]
            if bits & bit and other is not None and self.timing.outlasts(mine, other):
                return True
        return False

    def fired(self, bits: int, r: int, at: Sequence[int]) -> int:
        """The bits after role r fired a transition, leaving the roles in ``at``: r's deadline armed afresh or gone."""
        bits &= ~self.touching[r]
        if self.param[r][at[r]] is None:
            return bits
        for e, bit in self.shorter[r]:
            if self.param[e][at[e]] is not None:
                bits |= bit  # e's deadline was armed before r's, which is armed now
        return bits
