"""What the prefill and decode processes share: the verified role spec, its sends, and delivering messages to it.

A role runs the machine spec the explorer verified
(``specs/pd_abort/<role>_<protocol>.yaml``) in a :class:`~kvfsm.Tracker`. The
messages a transition sends are read from that spec (its ``send:`` lines) by
the tracker's observer, so the process sends exactly what the model
checker assumed, for every transition: fired by a message, by a local event,
by a timeout or by ``on_error``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

from ...engine import Tracker
from ...errors import ActionError, IllegalTransition
from ...spec import Spec
from ...spec.bundled import SPECS
from ...spec.system import System, load_system
from ...wire import Message, tag
from ...wire.listener import Listener
from ...wire.sender import Sender
from ..faults import FaultyActions
from .config import JobConfig
from .faults import MESSAGE_FAULTS, FaultyLink, plan


def system(protocol: str) -> System:
    """The composition ``specs/pd_abort/<protocol>.yaml``: both role specs and the messages between them."""
    return load_system(SPECS / "pd_abort" / f"{protocol}.yaml")


class Sends:
    """The tracker's observer: queues ``(room, message)`` for every ``send:`` of every transition taken."""

    def __init__(self, spec: Spec) -> None:
        self._sends = {(e.source, e.event): tuple(s.message for s in e.transition.sends) for e in spec.edges()}
        self.pending: list[tuple[Hashable, str]] = []

    def __call__(self, key: Hashable, generation: int, event: str, source: str | None, target: str, now: float) -> None:
        for message in self._sends.get((source or "", event), ()):
            self.pending.append((key, message))

    def drain(self) -> list[tuple[Hashable, str]]:
        out, self.pending = self.pending, []
        return out


class Role:
    """One side of the job: a tracker over the role's spec, its driver behind the role's fault plan, a listener,
    and a faulty link to the peer."""

    name = ""
    peer_name = ""
    actions: tuple[str, ...] = ()
    """The actions of this role's driver that raise under fault injection (``raising_<action>``)."""

    def __init__(
        self, config: JobConfig, driver: object, params: Mapping[str, float], port: int, peer_port: int, seed: int
    ) -> None:
        self.config = config
        self.system = system(config.protocol)
        self.spec = self.system.roles[self.name].spec
        self.sends = Sends(self.spec)
        self.rng = random.Random(seed)
        """The job's scenario (work times, aborts) and the mechanics of a fault (a delay's length, a mangling)."""
        raising = tuple(f"raising_{a}" for a in self.actions)
        self.faulty = FaultyActions(driver, plan(config.fault_rate / 2, raising, seed), self.actions)
        params = {k: v for k, v in params.items() if k in self.spec.params}  # the protocols differ in their params
        # One thread moves the tracker; a debug endpoint reading it from its own thread needs the lock.
        locked = config.metrics
        self.tracker = Tracker(self.spec, self.faulty, params=params, observer=self.sends, threadsafe=locked)
        self.listener = Listener(port=port, check=self.check)
        self.link = FaultyLink(
            Sender(f"tcp://127.0.0.1:{peer_port}"), plan(config.fault_rate, MESSAGE_FAULTS, seed), self.rng
        )
        self.injected: Counter[str] = Counter()
        """Faults and scenario events this role applied itself (a slow write, an abort)."""
        self.counts: Counter[str] = Counter()

    def check(self, message: Message) -> str | None:
        """Drop reason for a message this role must not take (runs in the listener thread)."""
        if message.peer != self.peer_name:
            return "unknown_id"
        if tag(message) in self.system.messages and self.system.messages[tag(message)].receiver != self.name:
            return "unexpected"
        return None

    def deliver(self, room: Hashable, event: str) -> None:
        """Fire ``event`` at ``room`` by its id space; what the spec refuses is counted, never raised."""
        try:
            self.tracker.fire_by(self.spec.key, room, event)
        except IllegalTransition:
            self.counts["illegal"] += 1
        except ActionError:
            self.counts["action_errors"] += 1

    def fire(self, room: Hashable, event: str) -> None:
        """A local event; an action that raised has already taken the spec's ``on_error`` path."""
        try:
            self.tracker.fire(room, event)
        except ActionError:
            self.counts["action_errors"] += 1

    def flush(self, now: float) -> None:
        """Send what the transitions taken since the last flush sent, then what a delay held back."""
        for room, name in self.sends.drain():
            message = self.compose(name, room)
            if message is not None:
                self.link.send(message, now)
        self.link.flush(now)

    def compose(self, name: str, room: Hashable) -> Message | None:
        raise NotImplementedError

    def live(self, room: Hashable) -> bool:
        """Whether the room's instance is still under way (not finished, not unknown)."""
        state = self.tracker.state(room)
        return state is not None and state in self.spec.live

    def stats(self) -> dict[str, Any]:
        listener = self.listener.stats()
        return {
            "faults": dict(self.injected + self.link.injected + self.faulty.injected),
            "drops": listener.drops,
            "listener_alive": listener.alive,
            "received": listener.received,
            "counts": dict(self.counts),
            "tracker": {k: v for k, v in self.tracker.counts.items() if v},
        }

    def close(self) -> None:
        self.listener.close()
        self.link.sender.close()


def expose(tracker: Tracker, config: JobConfig, report: Any, role: str) -> Any:
    """With ``config.metrics``: serve the tracker's state and metrics (kvfsm.observe) and tell the parent where."""
    if not config.metrics:
        return None
    from ...observe import serve

    port = config.metrics_port + (role == "decode") if config.metrics_port else 0
    server = serve([tracker], port=port)
    report.put(("metrics", role, server.url))
    return server


R = TypeVar("R", bound=Role)


def serve(name: str, make: Callable[[], R], run: Callable[[R], dict[str, Any]], config: JobConfig, report: Any) -> None:
    """A role process's entry point: make the role, run it and report its ledger under ``name``, or the error that
    stopped it; the role and its endpoint are closed either way."""
    try:
        role = make()
    except Exception as exc:
        report.put(("error", name, f"{type(exc).__name__}: {exc}"))
        return
    server = expose(role.tracker, config, report, name)
    try:
        report.put((name, run(role)))
    except Exception as exc:
        report.put(("error", name, f"{type(exc).__name__}: {exc}"))
    finally:
        if server is not None:
            server.close()
        role.close()
