"""One fault plan, and the wrappers that apply it (the data plane, driver actions), for every driver's fault tests,
demos and soaks.

:class:`FaultPlan` decides, from a hash of the seed and an opportunity's
key, whether the opportunity is hit (a fraction ``rate``) and by which fault
(uniformly among ``kinds``). The same plan gives the same faults in every
process and every run, so two engines that wrap their agents over one plan
agree, and what a run injects is known in advance (:meth:`FaultPlan.count`).

:class:`FaultyActions` wraps any driver and makes the actions it names
raise (``raising_<action>``), as a driver action that fails does.

:class:`FaultyAgent` wraps any agent of the data plane
(:mod:`kvfsm.drivers.dataplane`) and applies the faults that happen on its
own side:

- on a post of ``op`` (``read``, ``write``): ``raising_<op>`` (the post
  raises :class:`~kvfsm.drivers.dataplane.TransferError`) and ``failed_<op>``
  (the post goes where it cannot succeed: to addresses the peer never
  registered, which NIXL refuses at ``initialize_xfer``, or to
  ``unreachable``, a peer nobody listens at, which Mooncake answers failed);
- on a notification of kind ``k``, a post's own included: ``lost_<k>`` (it
  is not sent), ``duplicate_<k>`` (it is sent twice) and ``malformed_<k>``
  (it is followed by bytes no peer parses).

A protocol names its notifications with a :data:`Label`: their kind, and the
key the plan decides on (MoRIIO: the message type and its transfer id, so
each transfer meets one fault; NIXL: ``notif`` and the request id, so each
READ does). A post that carries no notification is keyed by its peer and a
count of this agent's posts.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from typing import Any

import torch

from ..drivers.dataplane import DataPlane, Extent, Op, TransferError, XferState

Label = Callable[[bytes], "tuple[str, str] | None"]
"""A notification's kind and the key its fault is decided on; None for bytes the protocol does not know."""

KIND = re.compile(r"(raising|failed|slow)_[a-z][a-z_]*|(lost|duplicate|malformed|delayed|reordered)_[a-z][a-z_]*")
"""What a fault's name says, where it strikes and how: ``raising_``, ``failed_`` and ``slow_`` a call (a post's
``read`` or ``write``, a driver's action, a store's call); ``lost_``, ``duplicate_``, ``malformed_``, ``delayed_``
and ``reordered_`` a message of the kind named."""

UNREGISTERED = 4096
"""An address no agent registers: a transfer to it is refused by the agent that owns the peer's memory."""

MALFORMED = (b"no-colon", b"p-1:", b":4", b"p-1:four", b"p-1:0", b"\xff\xfe:1")
"""What a ``malformed_`` fault sends: bytes neither NIXL's notification parser nor MoRIIO's msgpack codec accepts."""


class FaultPlan:
    """Which opportunities meet which fault: a fraction ``rate`` of them, one of ``kinds`` each.

    ``known``, when given, is every fault the caller's protocol can meet; a kind outside it is refused, so a
    misspelt fault fails at once instead of never striking.
    """

    def __init__(self, rate: float, kinds: Sequence[str], seed: int = 0, *, known: Iterable[str] = ()) -> None:
        known = tuple(known)
        unknown = sorted(k for k in kinds if not KIND.fullmatch(k) or (known and k not in known))
        if unknown:
            choose = f"choose from {list(known)}" if known else "name one as raising_<call>, failed_<call>, lost_<kind>"
            raise ValueError(f"unknown faults {unknown}; {choose}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], not {rate}")
        self.rate = rate
        self.kinds = tuple(kinds)
        self.seed = seed

    def fault(self, key: str, among: Collection[str] | None = None) -> str | None:
        """The fault that meets the opportunity ``key``, or None.

        ``among``: the faults that can strike this opportunity (a store's call meets only that call's); the
        plan's others are left out of the choice, so the opportunity is hit at the plan's rate whatever else the
        plan names. Without it, a fault chosen that does not fit the opportunity strikes nothing.
        """
        kinds = self.kinds if among is None else [k for k in self.kinds if k in among]
        if not kinds:
            return None
        h = zlib.crc32(f"{self.seed}/{key}".encode())
        if (h % 10_000) >= self.rate * 10_000:
            return None
        return kinds[(h // 10_000) % len(kinds)]

    def count(self, keys: Iterable[str], among: Collection[str] | None = None) -> Counter[str]:
        """How many of ``keys`` each fault hits (what a run injects, known in advance)."""
        return Counter(f for f in (self.fault(key, among) for key in keys) if f is not None)


def unlabelled(raw: bytes) -> tuple[str, str] | None:
    """The label of a protocol that names nothing: every notification is a ``notif``, keyed by its bytes."""
    return "notif", raw.hex()


class FaultyAgent:
    """``inner`` with the faults of ``plan`` applied to its own posts and notifications; ``injected`` counts them."""

    def __init__(
        self, inner: DataPlane, plan: FaultPlan, *, label: Label = unlabelled, unreachable: str | None = None
    ) -> None:
        self.inner = inner
        self.plan = plan
        self.label = label
        self.unreachable = unreachable
        self.injected: Counter[str] = Counter()
        self._posts = 0

    @property
    def name(self) -> str:
        return self.inner.name

    def register(self, tensor: torch.Tensor) -> None:
        self.inner.register(tensor)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def post(self, op: Op, peer: str, local: Sequence[Extent], remote: Sequence[Extent], notif: bytes) -> object:
        self._posts += 1
        named = self.label(notif) if notif else None
        key = named[1] if named is not None else f"{peer}#{self._posts}"
        fault = self.plan.fault(key)
        if self._hit(fault, "raising", op.lower()):
            raise TransferError(op, peer, "injected failure")
        if self._hit(fault, "failed", op.lower()):
            if self.unreachable is not None:
                peer = self.unreachable
            else:
                remote = _unregistered(remote)
        if named is None:
            return self.inner.post(op, peer, local, remote, notif)
        kind = named[0]
        handle = self.inner.post(op, peer, local, remote, b"" if self._hit(fault, "lost", kind) else notif)
        self._after(fault, kind, peer, notif, key)
        return handle

    def state(self, handle: object) -> XferState:
        return self.inner.state(handle)

    def release(self, handle: object) -> None:
        self.inner.release(handle)

    def send_notif(self, peer: str, message: bytes) -> None:
        named = self.label(message)
        if named is None:
            self.inner.send_notif(peer, message)
            return
        kind, key = named
        fault = self.plan.fault(key)
        if self._hit(fault, "lost", kind):
            return
        self.inner.send_notif(peer, message)
        self._after(fault, kind, peer, message, key)

    def notifs(self) -> list[tuple[str, bytes]]:
        return self.inner.notifs()

    def _hit(self, fault: str | None, how: str, kind: str) -> bool:
        """Whether ``fault`` is ``how`` for ``kind`` (a post's op, a notification's kind); counted if it is."""
        if fault != f"{how}_{kind}":
            return False
        self.injected[fault] += 1
        return True

    def _after(self, fault: str | None, kind: str, peer: str, message: bytes, key: str) -> None:
        """What follows a notification that went out: its duplicate, or bytes no peer parses."""
        if self._hit(fault, "duplicate", kind):
            self.inner.send_notif(peer, message)
        elif self._hit(fault, "malformed", kind):
            self.inner.send_notif(peer, MALFORMED[zlib.crc32(key.encode()) % len(MALFORMED)])


def _unregistered(remote: Sequence[Extent]) -> list[Extent]:
    """``remote``'s lengths at addresses nobody registered."""
    out, at = [], UNREGISTERED
    for _addr, n in remote:
        out.append((at, n))
        at += n
    return out


class InjectedFault(RuntimeError):
    """What a ``raising_<action>`` fault raises: distinct from every error a driver raises of its own."""


class FaultyActions:
    """``inner`` with ``raising_<action>`` faults from ``plan`` on the actions named; every other attribute is
    ``inner``'s. Handed to a :class:`~kvfsm.Tracker` as its driver, a faulted action raises as a real one does,
    before it ran, and the spec's ``on_error`` path takes the instance; ``injected`` counts them. The plan decides
    per action and key, so each instance meets an action's fault at most once."""

    def __init__(self, inner: object, plan: FaultPlan, actions: Iterable[str]) -> None:
        self.inner = inner
        self.plan = plan
        self.injected: Counter[str] = Counter()
        for name in actions:
            setattr(self, name, self._faulty(name, getattr(inner, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _faulty(self, name: str, action: Callable[..., object]) -> Callable[..., object]:
        fault = f"raising_{name}"

        def act(key: Hashable, /, **payload: Any) -> object:
            if self.plan.fault(f"{name}/{key}") == fault:
                self.injected[fault] += 1
                raise InjectedFault(f"injected: {name} for {key!r} failed")
            return action(key, **payload)

        act.__name__ = name
        return act
