"""Model-based tests of a driver, generated from its spec (Hypothesis stateful testing).

>>> import kvfsm.testing
>>> TestMyDriver = kvfsm.testing.spec_machine("specs/kv_request.yaml", MyDriver).TestCase
>>> report = kvfsm.testing.run("specs/kv_request.yaml", MyDriver, examples=1000)

The driver must have ``observe(key)``, its real resources for the key; see
:mod:`kvfsm.testing.machine` for the whole protocol and ``docs/testing.md``
for a walk-through.
"""

from .coverage import Coverage, EdgeCount
from .machine import KEYS, DriverFactory, SpecMachine, VirtualClock, fault_targets, spec_machine
from .model import Outcome, SpecModel, Step
from .runner import STEPS, FactoryError, Report, load_factory, run
from .story import Divergence

__all__ = [
    "KEYS",
    "STEPS",
    "Coverage",
    "Divergence",
    "DriverFactory",
    "EdgeCount",
    "FactoryError",
    "Outcome",
    "Report",
    "SpecMachine",
    "SpecModel",
    "Step",
    "VirtualClock",
    "fault_targets",
    "load_factory",
    "run",
    "spec_machine",
]
