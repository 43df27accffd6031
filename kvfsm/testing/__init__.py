"""Model-based tests of a driver, generated from its spec (Hypothesis stateful testing).

>>> import kvfsm.testing
>>> TestMyDriver = kvfsm.testing.spec_machine("specs/kv_request.yaml", MyDriver).TestCase
>>> report = kvfsm.testing.run("specs/kv_request.yaml", MyDriver, examples=1000)
>>> result = kvfsm.testing.replay_trace("specs/pd_abort/merged_fix.yaml", "trace.json", {"decode": MyDecode})

The driver must have ``observe(key)``, its real resources for the key; see
:mod:`kvfsm.testing.machine` for the whole protocol, :mod:`kvfsm.testing.trace_replay`
for replaying an explorer trace, and ``docs/testing.md`` for a walk-through.
"""

from .coverage import Coverage, EdgeCount
from .ledger import LedgerDriver
from .machine import KEYS, DriverFactory, SpecMachine, VirtualClock, fault_targets, spec_machine
from .model import Outcome, SpecModel, Step
from .runner import STEPS, FactoryError, Report, load_factory, run
from .story import Divergence
from .trace_replay import Mismatch, Replay, ReplayResult, StepReplay, replay_trace

__all__ = [
    "KEYS",
    "STEPS",
    "Coverage",
    "Divergence",
    "DriverFactory",
    "EdgeCount",
    "FactoryError",
    "LedgerDriver",
    "Mismatch",
    "Outcome",
    "Replay",
    "ReplayResult",
    "Report",
    "SpecMachine",
    "SpecModel",
    "Step",
    "StepReplay",
    "VirtualClock",
    "fault_targets",
    "load_factory",
    "replay_trace",
    "run",
    "spec_machine",
]
