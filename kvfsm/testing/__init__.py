"""Test a driver against its spec: model-based tests, trace replay, random specs (Hypothesis).

>>> import kvfsm.testing
>>> TestMyDriver = kvfsm.testing.spec_machine("specs/kv_request.yaml", MyDriver).TestCase
>>> report = kvfsm.testing.run("specs/kv_request.yaml", MyDriver, examples=1000)
>>> report = kvfsm.testing.run(spec, MyDriver, bar=kvfsm.testing.Bar(exempt={"ignored abort in done": "why"}))
>>> result = kvfsm.testing.replay_trace("specs/pd_abort/merged_fix.yaml", "trace.json", {"decode": MyDecode})
>>> covered = kvfsm.testing.cover_system("specs/pd_abort/corrected.yaml", {"decode": MyDecode})
>>> @given(kvfsm.testing.strategies.specs())
... def test_my_property(spec): ...

The driver must have ``observe(key)``, its real resources for the key; the
whole contract is :mod:`kvfsm.testing.contract`. ``spec_tests`` (the pytest
helper, :mod:`kvfsm.testing.plugin`) needs pytest and is imported on first
use. Internals (the oracle :mod:`kvfsm.testing.oracle`, coverage counts, the
story lines) stay importable from their modules. ``docs/testing.md`` walks
through all of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import strategies
from .bar import Bar
from .clock import VirtualClock
from .contract import (
    DriverFactory,
    FaultInjecting,
    ObservableDriver,
    ReceivesMessages,
    ReportsSends,
    TakesBeforeBegin,
    TakesBeforeFire,
)
from .ledger import LedgerDriver
from .machine import SpecMachine, spec_machine
from .runner import RunReport, run
from .story import SpecViolation
from .trace_replay import TraceResult, TraceRun, replay_trace
from .trace_set import SystemCoverage, TraceSet, cover_system, trace_set

if TYPE_CHECKING:
    from .plugin import spec_tests

__all__ = [
    "Bar",
    "DriverFactory",
    "FaultInjecting",
    "LedgerDriver",
    "ObservableDriver",
    "ReceivesMessages",
    "ReportsSends",
    "RunReport",
    "SpecMachine",
    "SpecViolation",
    "SystemCoverage",
    "TakesBeforeBegin",
    "TakesBeforeFire",
    "TraceResult",
    "TraceRun",
    "TraceSet",
    "VirtualClock",
    "cover_system",
    "replay_trace",
    "run",
    "spec_machine",
    "spec_tests",
    "strategies",
    "trace_set",
]


def __getattr__(name: str) -> Any:
    """``spec_tests`` comes from the pytest plugin, which needs pytest: imported only when asked for."""
    if name == "spec_tests":
        from .plugin import spec_tests

        return spec_tests
    raise AttributeError(f"module 'kvfsm.testing' has no attribute {name!r}")
