"""The generated machine's mid-example ``close()``: what close releases, and that a closed tracker refuses all work.

Tracker.close() aborts every live instance and releases by force what abort
cannot finish (in ``pd_abort/decode_corrected.yaml`` an abort keeps the pages
while decode waits for prefill's answer, so close releases them directly);
afterwards begin and fire raise TrackerClosed. The generated machine closes in
one example in four and keeps stepping, so both halves are checked on real
drivers: the PD loopback's decode side, which owns pages of a real pool.
"""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import suppress
from typing import Any

import pytest
from buggy_drivers import KV_REQUEST, StoreSender, frees_only_on_ack

from kvfsm import Tracker, TrackerClosed
from kvfsm.drivers.pd_loopback import DecodeDriver, PDLoopback
from kvfsm.spec.bundled import SPECS
from kvfsm.testing import SpecViolation, run, spec_machine

DECODE = SPECS / "pd_abort" / "decode_corrected.yaml"


def decode_driver() -> DecodeDriver:
    return DecodeDriver(PDLoopback())


@pytest.mark.parametrize(("spec", "factory"), [(KV_REQUEST, StoreSender), (DECODE, decode_driver)], ids=["kv", "pd"])
def test_correct_drivers_pass_with_closes_mid_example(spec: object, factory: Any) -> None:
    report = run(spec, factory, seed=0)  # type: ignore[arg-type]
    assert report.passed, "\n".join(report.story) or report.error
    cov = report.coverage
    assert 0 < cov.mid_example_closes < cov.examples / 2, "some examples close mid-way, most run to the end"
    assert cov.refused_closed > 0, "begins and fires after a close were tried (and refused)"


def test_a_forced_release_is_checked_and_every_later_call_must_be_refused() -> None:
    """A room waiting on prefill: close aborts it (→ aborting, still live), then frees its pages by force."""
    machine = spec_machine(DECODE, decode_driver)()
    machine.begin("req-1")
    machine.fire("req-1", "bootstrapped")
    machine.close()
    machine.agrees_with_spec()
    assert machine.story[-1] == (
        "t=0.0 close() → abort req-1: waiting → aborting; req-1 released by force (abort cannot finish it)"
    )
    machine.begin("req-2")
    machine.fire("req-1", "success")  # a late status for the room close released
    machine.advance(300.0)
    machine.drain()
    machine.agrees_with_spec()
    machine.teardown()
    assert machine.story[-5:-1] == [
        "t=0.0 begin req-2: tracker closed (TrackerClosed, nothing may change)",
        "t=0.0 success req-1: tracker closed (TrackerClosed, nothing may change)",
        "t=300.0 clock +300, poll() → nothing due",
        "t=300.0 finished() → nothing",
    ]
    assert machine.story[-1] == "t=300.0 close() again → nothing to do"
    driver = machine.driver
    assert isinstance(driver, DecodeDriver)
    assert driver.loop.decode_pool.referenced() == {} and all(driver.observe(k) == set() for k in machine.keys)
    with pytest.raises(TrackerClosed):
        machine.tracker.begin("req-3")


def test_pages_kept_when_close_forces_their_release_are_caught_at_the_close() -> None:
    """Seed 002's deferred free: release_kv_cache only logs, so close's forced release leaves the pages in use."""
    machine = spec_machine(DECODE, frees_only_on_ack)()
    machine.begin("req-1")
    machine.fire("req-1", "bootstrapped")
    machine.close()
    with pytest.raises(SpecViolation) as caught:
        machine.agrees_with_spec()
    assert caught.value.problems == (
        "observe says kv_pages still held by req-1 (req-1 has no instance, which holds nothing)",
    )
    assert caught.value.trace[-1] == ("close", ())


def test_the_same_leak_is_found_by_a_default_run() -> None:
    report = run(DECODE, frees_only_on_ack, seed=0)
    assert not report.passed and "observe says kv_pages still held" in report.story[-1]


class SwallowsTrackerClosed(Tracker):
    """A tracker that lets a begin after close() pass silently: the refusal the spec promises is lost."""

    def begin(self, key: Hashable, /, **payload: Any) -> None:
        with suppress(TrackerClosed):
            super().begin(key, **payload)


def test_a_tracker_that_does_not_refuse_a_begin_after_close_is_caught() -> None:
    class Machine(spec_machine(KV_REQUEST, StoreSender)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.tracker = SwallowsTrackerClosed(self.spec, self.driver, clock=self.clock)

    machine = Machine()
    machine.begin("req-1")
    machine.close()
    with pytest.raises(SpecViolation, match="no TrackerClosed, but the tracker is closed"):
        machine.begin("req-2")
