"""kvfsm.testing's public surface, its manual clock and its driver contract."""

from __future__ import annotations

import math

import pytest
from buggy_drivers import KV_REQUEST, StoreSender

import kvfsm.testing
from kvfsm.testing import FaultInjecting, ObservableDriver, TakesBeforeBegin, VirtualClock, run


def test_every_public_name_is_importable_and_the_oracles_internals_are_not_public() -> None:
    for name in kvfsm.testing.__all__:
        assert getattr(kvfsm.testing, name) is not None
    assert not {"SpecModel", "Outcome", "Move", "EdgeCount", "KEYS", "STEPS"} & set(kvfsm.testing.__all__)


def test_spec_tests_comes_from_the_pytest_plugin() -> None:
    from kvfsm.testing.plugin import spec_tests

    assert kvfsm.testing.spec_tests is spec_tests


def test_the_clock_moves_only_when_told() -> None:
    clock = VirtualClock()
    assert clock() == 0.0
    assert clock.advance(1.5) == 1.5 and clock() == 1.5
    clock.now = 10.0
    assert clock() == 10.0


@pytest.mark.parametrize("seconds", [-1.0, math.nan])
def test_the_clock_refuses_to_run_backwards_or_to_nan(seconds: float) -> None:
    with pytest.raises(ValueError, match="time only moves forward"):
        VirtualClock().advance(seconds)


def test_a_driver_with_the_whole_contract_satisfies_each_protocol() -> None:
    driver = StoreSender()
    assert isinstance(driver, ObservableDriver)
    assert isinstance(driver, FaultInjecting)
    assert isinstance(driver, TakesBeforeBegin)


class DeclinesFaults(StoreSender):
    """Cannot make any action raise, and says so: the model-based test must not expect a failure."""

    def inject_fault(self, action: str) -> bool:
        return False


def test_a_driver_that_declines_a_fault_is_tested_without_it() -> None:
    report = run(KV_REQUEST, DeclinesFaults, examples=30, seed=3)
    assert report.passed, "\n".join(report.story) or report.error
    assert not report.coverage.faults
