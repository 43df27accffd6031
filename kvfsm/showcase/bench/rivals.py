"""The kv_request lifecycle written with the general state-machine libraries, used the way their docs suggest.

Both do the same driver work as the Tracker (``do``/acquire before the state
change, releases after it, a deadline armed on entering ``transferring`` and
lazily disarmed on leaving it, a finished list drained at the end) through the
library's own callbacks, behind the same small ``begin``/``fire``/``finished``
surface as the Tracker so one workload loop drives every variant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from typing import Any

FINALS = ("done", "failed", "aborted", "expired")


class _Deadlines:
    """A deadline heap keyed by request, lazily disarmed: what each rival keeps beside its machine."""

    def __init__(self, clock: Callable[[], float], after: float) -> None:
        self.clock = clock
        self.after = after
        self.heap: list[tuple[float, int, Hashable]] = []
        self.armed: dict[Hashable, tuple[float, int, Hashable]] = {}
        self.seq = itertools.count()

    def arm(self, key: Hashable) -> None:
        entry = (self.clock() + self.after, next(self.seq), key)
        self.armed[key] = entry
        heapq.heappush(self.heap, entry)

    def disarm(self, key: Hashable) -> None:
        del self.armed[key]


class TransitionsTracker:
    """One shared ``transitions.Machine`` (auto_transitions=False); a model per request via add_model."""

    def __init__(self, driver: Any, clock: Callable[[], float], transfer_timeout: float = 30.0) -> None:
        from transitions import Machine

        self.deadlines = _Deadlines(clock, transfer_timeout)
        self.models: dict[Hashable, Any] = {}
        self.done: list[Hashable] = []
        free, task_done = driver.free_gpu_blocks, driver.task_done
        live = ["pinned", "queued", "transferring"]
        states: list[Any] = [
            "pinned",
            "queued",
            {"name": "transferring", "on_enter": [self.deadlines.arm], "on_exit": [self.deadlines.disarm]},
            *({"name": f, "on_enter": [self.done.append]} for f in FINALS),
        ]
        transitions: list[dict[str, Any]] = [
            {"trigger": "enqueue", "source": "pinned", "dest": "queued", "before": [driver.enqueue_job]},
            {"trigger": "start", "source": "queued", "dest": "transferring", "before": [driver.start_transfer]},
            {"trigger": "complete", "source": "transferring", "dest": "done", "after": [free, task_done]},
            {"trigger": "expire", "source": "transferring", "dest": "expired", "after": [free, task_done]},
        ]
        for event, target in (("fail", "failed"), ("abort", "aborted")):
            transitions.append({"trigger": event, "source": "pinned", "dest": target, "after": [free]})
            transitions.append({"trigger": event, "source": live[1:], "dest": target, "after": [free, task_done]})
        for event in ("abort", "complete", "fail", "expire"):
            transitions.append({"trigger": event, "source": list(FINALS), "dest": None})  # ignore rule
        self.machine = Machine(
            model=None, states=states, transitions=transitions, initial="pinned", auto_transitions=False
        )

    def begin(self, key: Hashable) -> None:
        model = _Model()
        self.machine.add_model(model)
        self.models[key] = model

    def fire(self, key: Hashable, event: str) -> object:
        return self.models[key].trigger(event, key)

    def finished(self) -> list[tuple[Hashable, str]]:
        done, self.done = self.done, []
        out = []
        for key in done:
            model = self.models.pop(key)
            self.machine.remove_model(model)
            out.append((key, model.state))
        return out


class _Model:
    """A bare model object; transitions attaches the state and the trigger methods to it."""

    state: str
    trigger: Callable[..., bool]


def statemachine_tracker(driver: Any, clock: Callable[[], float], transfer_timeout: float = 30.0) -> Any:
    """One python-statemachine ``StateMachine`` per request (it cannot share one machine across models)."""
    from statemachine import State, StateMachine

    class KVRequest(StateMachine):
        pinned = State(initial=True)
        queued = State()
        transferring = State()
        done = State(final=True)
        failed = State(final=True)
        aborted = State(final=True)
        expired = State(final=True)

        enqueue = pinned.to(queued)
        start = queued.to(transferring)
        complete = transferring.to(done)
        expire = transferring.to(expired)
        fail = pinned.to(failed) | queued.to(failed) | transferring.to(failed)
        abort = pinned.to(aborted) | queued.to(aborted) | transferring.to(aborted)

        def __init__(self, key: Hashable, owner: StatemachineTracker) -> None:
            self.key = key
            self.owner = owner
            super().__init__()

        def before_enqueue(self) -> None:
            self.owner.driver.enqueue_job(self.key)

        def before_start(self) -> None:
            self.owner.driver.start_transfer(self.key)

        def on_enter_transferring(self) -> None:
            self.owner.deadlines.arm(self.key)

        def on_exit_transferring(self) -> None:
            self.owner.deadlines.disarm(self.key)

        def after_transition(self, source: Any, target: Any) -> None:
            if target.final:
                self.owner.driver.free_gpu_blocks(self.key)
                if source.id != "pinned":
                    self.owner.driver.task_done(self.key)
                self.owner.done.append(self.key)

    return StatemachineTracker(KVRequest, driver, _Deadlines(clock, transfer_timeout))


class StatemachineTracker:
    def __init__(self, machine_class: Any, driver: Any, deadlines: _Deadlines) -> None:
        self.machine_class = machine_class
        self.driver = driver
        self.deadlines = deadlines
        self.machines: dict[Hashable, Any] = {}
        self.done: list[Hashable] = []

    def begin(self, key: Hashable) -> None:
        self.machines[key] = self.machine_class(key, self)

    def fire(self, key: Hashable, event: str) -> object:
        return self.machines[key].send(event)

    def finished(self) -> list[tuple[Hashable, str]]:
        done, self.done = self.done, []
        machines = self.machines
        return [(key, machines.pop(key).current_state_value) for key in done]
