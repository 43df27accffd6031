"""A transition's own release action (``release: {resource: action}``): what a release reports, said by the spec.

A load's report tells vLLM which blocks to recompute. Every way out reports
them all invalid, except the edge that byte-checked them. Drivers used to keep
a ``verified`` flag, set by the check and read by the one release; the flag
was a lifecycle fact outside the spec. Here the checked edge names its own
release, and the driver's two releases each say one thing.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from kvfsm import Tracker
from kvfsm.spec import read_text, run_checks
from kvfsm.testing import run

LOAD = """\
kvfsm: 1
machine: load
key: request_id
resources:
  dst_blocks: {acquire: pin_dst, release: unpin_dst, doc: "the blocks the read fills; reported when let go"}
states:
  reading: {initial: true, holds: [dst_blocks], timeout: {after: 30.0, fire: expire}}
  loaded:  {final: success}
  failed:  {final: failure}
transitions:
  - {event: complete, from: reading, to: loaded, do: verify, release: {dst_blocks: unpin_loaded}}
  - {event: expire,   from: reading, to: failed}
  - {event: fail,     from: reading, to: failed}
  - {event: abort,    from: reading, to: failed}
ignore:
  - {event: [complete, expire, fail, abort], in: [loaded, failed]}
on_error: fail
"""


class Reader:
    """Reports each load once: valid only from the checked edge's release."""

    def __init__(self) -> None:
        self.held: set[Hashable] = set()
        self.reports: list[tuple[Hashable, str]] = []
        self.bad: set[Hashable] = set()

    def pin_dst(self, key: Hashable) -> None:
        self.held.add(key)

    def verify(self, key: Hashable) -> None:
        if key in self.bad:
            raise ValueError(f"{key!r}: a block does not hold the prefill's KV")

    def unpin_dst(self, key: Hashable) -> None:
        self.held.remove(key)
        self.reports.append((key, "invalid"))

    def unpin_loaded(self, key: Hashable) -> None:
        self.held.remove(key)
        self.reports.append((key, "valid"))

    def observe(self, key: Hashable) -> set[str]:
        return {"dst_blocks"} if key in self.held else set()


SPEC = read_text(LOAD)


def test_only_the_checked_edge_reports_the_blocks_valid() -> None:
    assert run_checks(SPEC) == []
    reader = Reader()
    tracker = Tracker(SPEC, reader)
    for key in ("ok", "bad", "slow", "gone"):
        tracker.begin(key)
    reader.bad.add("bad")
    tracker.fire("ok", "complete")
    with pytest.raises(Exception, match="does not hold"):
        tracker.fire("bad", "complete")  # the check raised: on_error, and the report says invalid
    tracker.fire("gone", "abort")
    tracker.close()  # "slow" is aborted by close
    assert sorted(reader.reports) == [("bad", "invalid"), ("gone", "invalid"), ("ok", "valid"), ("slow", "invalid")]
    assert not reader.held


def test_kvfsm_test_holds_the_driver_to_the_spec_s_release() -> None:
    report = run(SPEC, Reader, seed=0, examples=15)
    assert report.passed, "\n".join(report.story) or report.error


def test_kvf120_names_an_undeclared_resource_with_its_line() -> None:
    text = LOAD.replace("release: {dst_blocks: unpin_loaded}", "release: {blocks: unpin_loaded}")
    (finding,) = [f for f in run_checks(read_text(text)) if f.code == "KVF120"]
    assert "undeclared resource 'blocks'" in finding.message and finding.line == 11


def test_kvf120_a_source_that_keeps_the_resource_and_an_action_shared_with_another() -> None:
    keeps = LOAD.replace(
        "  - {event: abort,    from: reading, to: failed}\n",
        "  - {event: abort,    from: reading, to: failed}\n  - {event: poke, from: reading, to: reading, "
        "release: {dst_blocks: unpin_loaded}}\n",
    ).replace("in: [loaded, failed]}", "in: [loaded, failed]}\n  - {event: poke, in: [loaded, failed]}")
    (finding,) = [f for f in run_checks(read_text(keeps)) if f.code == "KVF120"]
    assert "from 'reading' it releases no 'dst_blocks'" in finding.message
    shared = LOAD.replace("release: {dst_blocks: unpin_loaded}", "release: {dst_blocks: pin_dst}")
    assert not [f for f in run_checks(read_text(shared)) if f.code == "KVF120"]  # an acquire is not a release
    two = LOAD.replace("resources:\n", "resources:\n  report: {release: report_it, doc: owed}\n").replace(
        "release: {dst_blocks: unpin_loaded}", "release: {dst_blocks: report_it}"
    )
    (finding,) = [f for f in run_checks(read_text(two)) if f.code == "KVF120"]
    assert "also resource 'report''s own release" in finding.message
