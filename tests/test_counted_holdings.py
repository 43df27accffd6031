"""A resource held more than once by one instance: a hit pinned again by a lookup in the same step.

vLLM asks ``get_num_new_matched_tokens`` again for a request it could not
schedule; a connector that pins on each lookup holds the hit twice until the
allocation gives one back. Kept as a set of names, the second pin is
invisible and the first release frees blocks the other still needs. Written
``holds: {pin: 2}``, every edge acquires and releases the difference one unit
at a time, ``held()`` lists the units, and a driver whose ``observe`` reports
counts is compared unit by unit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import pytest

import kvfsm
from kvfsm import Tracker
from kvfsm.spec import SpecError, read_text, run_checks
from kvfsm.testing import run

RELOOKUP = """\
kvfsm: 1
machine: relookup
key: request_id
resources:
  pin: {acquire: pin_hit, release: unpin_hit, doc: "one reference on the hit's CPU blocks"}
states:
  found:       {initial: true, holds: [pin], waits: local}
  found_again: {holds: {pin: 2}, waits: local, doc: "looked up again in the same step: pinned twice"}
  loading:     {holds: [pin], timeout: {after: 5.0, fire: expire}}
  loaded:      {final: success}
  failed:      {final: failure}
transitions:
  - {event: lookup,   from: found,                to: found_again}
  - {event: allocate, from: [found, found_again], to: loading}
  - {event: complete, from: loading,              to: loaded}
  - {event: expire,   from: loading,              to: failed}
  - {event: fail,     from: [found, found_again, loading], to: failed}
  - {event: abort,    from: "*",                  to: failed}
ignore:
  - {event: lookup, in: [found_again, loading]}
  - {event: [lookup, allocate, complete, expire, fail, abort], in: [loaded, failed]}
on_error: fail
"""


class PinCounter:
    """Pins counted per request, as a block pool's reference counts are."""

    def __init__(self) -> None:
        self.pins: Counter[Hashable] = Counter()

    def pin_hit(self, key: Hashable) -> None:
        self.pins[key] += 1

    def unpin_hit(self, key: Hashable) -> None:
        if not self.pins[key]:
            raise RuntimeError(f"{key!r} holds no pin")
        self.pins[key] -= 1

    def observe(self, key: Hashable) -> dict[str, int]:
        return {"pin": self.pins[key]} if self.pins[key] else {}


class PinSet(PinCounter):
    """The hand-written shape: pinned or not, a set of requests; the second pin is lost, one unpin frees all."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: set[Hashable] = set()

    def pin_hit(self, key: Hashable) -> None:
        self.pinned.add(key)

    def unpin_hit(self, key: Hashable) -> None:
        self.pinned.discard(key)

    def observe(self, key: Hashable) -> dict[str, int]:
        return {"pin": 1} if key in self.pinned else {}


SPEC = read_text(RELOOKUP)


def test_a_count_is_written_as_a_mapping_and_each_edge_moves_the_difference() -> None:
    assert run_checks(SPEC) == []
    assert SPEC.states["found_again"].holds == ("pin", "pin")
    assert SPEC.acquires("found", "found_again") == ("pin",)
    assert SPEC.releases("found_again", "loading") == ("pin",)
    assert SPEC.releases("found_again", "failed") == ("pin", "pin")


def test_the_engine_pins_twice_and_gives_back_one_unit_at_a_time() -> None:
    driver = PinCounter()
    tracker = Tracker(SPEC, driver)
    tracker.begin("r")
    tracker.fire("r", "lookup")
    assert driver.pins["r"] == 2 and tracker.held("r") == ("pin", "pin")
    assert tracker.holding() == {"pin": 2}
    tracker.fire("r", "allocate")
    assert driver.pins["r"] == 1 and tracker.held("r") == ("pin",)
    tracker.begin("s")
    tracker.fire("s", "lookup")
    tracker.fire("s", "abort")  # both units given back
    assert driver.pins["s"] == 0
    tracker.fire("r", "complete")
    assert +driver.pins == Counter()


def test_a_final_state_left_holding_a_unit_is_refused_by_the_checker() -> None:
    """The count above zero at the end, written in the spec: KVF104, as for any resource a final state keeps."""
    bad = RELOOKUP.replace("loaded:      {final: success}", "loaded:      {final: success, holds: {pin: 1}}")
    codes = [(f.code, f.line) for f in run_checks(read_text(bad))]
    assert ("KVF104", 10) in codes


def test_kvfsm_test_passes_the_counting_driver_and_catches_the_set() -> None:
    good = run(SPEC, PinCounter, seed=0, examples=20)
    assert good.passed, "\n".join(good.story) or good.error
    bad = run(SPEC, PinSet, seed=0, examples=20)
    assert not bad.passed
    assert "observe says req-" in bad.error or any("holds pin (" in line for line in bad.story), bad.error
    assert "which holds pin ×2" in bad.error + "\n".join(bad.story)


@pytest.mark.parametrize(
    ("holds", "message"),
    [
        ("{pin: 0}", "must be at least 1"),
        ("{pin: two}", "must be a whole number"),
        ("{pin: 1, pin: 2}", "names 'pin' twice"),
    ],
)
def test_a_bad_count_names_the_line_and_the_fix(holds: str, message: str) -> None:
    text = RELOOKUP.replace("holds: {pin: 2}", f"holds: {holds}")
    with pytest.raises(SpecError) as raised:
        read_text(text, "relookup.yaml")
    assert message in str(raised.value) and "relookup.yaml:8" in str(raised.value)


def test_kvfsm_parse_reads_the_same() -> None:
    assert kvfsm.parse(RELOOKUP).states["found_again"].holds == ("pin", "pin")


def test_the_diagram_says_how_many_units_a_state_holds() -> None:
    from kvfsm.gen.diagram import to_dot, to_mermaid

    assert "holds pin ×2" in to_mermaid(SPEC) and "holds: pin ×2" in to_dot(SPEC)
