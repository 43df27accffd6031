"""The oracle that generated tests hold the Tracker to (kvfsm.testing.oracle), on its own and against the Tracker.

The oracle reads the spec model alone; the Tracker compiles the spec into
tables of its own. On a spec that uses every feature the oracle interprets
(acquires at begin, a timeout with an action into a live state, an on_error
path into a final state, an abort into a live state that close() cannot
finish), hundreds of random examples of a real driver with faults must find
no disagreement; the tests below pin the oracle's driver calls to DESIGN.md
on their own.
"""

from __future__ import annotations

import pytest
from buggy_drivers import pool_driver

import kvfsm
from kvfsm.testing import RunReport, run
from kvfsm.testing.oracle import Call, SpecModel

SPEC = kvfsm.parse(
    """
kvfsm: 1
machine: retrying_send
key: request_id
params: {transfer_timeout: 5.0, retry_timeout: 2.0}
resources:
  gpu_blocks: {acquire: alloc_gpu_blocks, release: free_gpu_blocks}
  host_buf:   {acquire: alloc_host_buf, release: free_host_buf}
  lease:      {acquire: take_lease, release: drop_lease}
states:
  pinned:       {initial: true, holds: [gpu_blocks, host_buf], waits: local}
  transferring: {holds: [gpu_blocks, lease], timeout: {after: transfer_timeout, fire: expire}}
  retrying:     {holds: [gpu_blocks], timeout: {after: retry_timeout, fire: give_up}}
  draining:     {holds: [gpu_blocks], timeout: {after: retry_timeout, fire: drained}}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
transitions:
  - {event: start,    from: pinned,       to: transferring, do: start_transfer}
  - {event: complete, from: transferring, to: done,         do: finish_transfer}
  - {event: expire,   from: transferring, to: retrying,     do: note_expiry}
  - {event: retry,    from: retrying,     to: transferring, do: reconnect}
  - {event: give_up,  from: retrying,     to: failed}
  - {event: fail,     from: [pinned, transferring, retrying, draining], to: failed}
  - {event: abort,    from: [pinned, retrying, draining], to: aborted}
  - {event: abort,    from: transferring, to: draining}
  - {event: drained,  from: draining,     to: aborted}
ignore:
  - {event: [abort, complete, fail, expire, give_up, drained], in: [done, failed, aborted]}
on_error: fail
""",
    "retrying_send.yaml",
)
"""Abort from transferring leads to draining, which is live: close() must release it by force."""


@pytest.fixture(scope="module", params=[0, 1])
def agreement(request: pytest.FixtureRequest) -> RunReport:
    return run(SPEC, pool_driver(SPEC), seed=request.param)


def test_the_model_agrees_with_the_tracker_on_every_feature_it_interprets(agreement: RunReport) -> None:
    assert agreement.passed, "\n".join(agreement.story) or agreement.error


def test_the_runs_reach_every_feature_the_model_interprets(agreement: RunReport) -> None:
    cov = agreement.coverage
    taken = cov.taken()
    assert taken["transferring", "expire"] and taken["retrying", "give_up"] and taken["transferring", "abort"]
    assert cov.faults["alloc_gpu_blocks"] + cov.faults["alloc_host_buf"] > 0  # a begin failed: nothing begun
    assert cov.faults["note_expiry"] > 0  # a timeout's action raised inside poll()
    assert cov.forced > 0  # close() released instances that abort leaves in draining


def model() -> SpecModel:
    return SpecModel(SPEC)


def test_a_fault_in_a_do_action_fires_on_error_from_the_source() -> None:
    m = model()
    m.begin("r")
    m.inject("start_transfer")
    out = m.fire("r", "start")
    assert [f.as_tuple() for f in out.failures] == [("r", "start", "start_transfer", "do", "failed")]
    assert [(s.event, s.source, s.target, s.how) for s in out.moves] == [("fail", "pinned", "failed", "on_error")]
    assert m.state("r") == "failed" and not m.faults


def test_a_fault_at_begin_begins_nothing() -> None:
    m = model()
    m.inject("alloc_host_buf")
    out = m.begin("r")
    assert [f.as_tuple() for f in out.failures] == [("r", "begin", "alloc_host_buf", "acquire", "(not begun)")]
    assert m.state("r") is None and m.held("r") == ()


def test_timeouts_fire_by_state_declaration_then_arming_order_and_new_ones_wait() -> None:
    m = model()
    for key in ("a", "b"):
        m.begin(key)
        m.fire(key, "start")
    m.now = 3.0
    m.begin("c")
    m.fire("c", "start")  # due at 8.0
    m.now = 5.0
    out = m.poll()
    assert out.fired == [("a", "expire", "retrying"), ("b", "expire", "retrying")]
    m.now = 8.0
    out = m.poll()  # retrying (declared after transferring) is due at 7.0, transferring's c at 8.0
    assert out.fired == [("c", "expire", "retrying"), ("a", "give_up", "failed"), ("b", "give_up", "failed")]


def test_begin_of_a_live_key_is_refused_and_a_finished_one_is_begun_again() -> None:
    m = model()
    m.begin("r")
    assert m.begin("r").refused == "duplicate"
    m.fire("r", "abort")
    assert m.begin("r").moves  # final but not drained: a new generation
    assert m.drain().drained == [("r", "aborted")]
    assert m.state("r") == "pinned"  # the new instance survives the drain of the old one


def test_close_aborts_and_forces_what_abort_cannot_finish() -> None:
    m = model()
    m.begin("r")
    m.fire("r", "start")
    out = m.close()
    assert [(s.source, s.target) for s in out.moves] == [("transferring", "draining")]
    assert out.forced == ["r"] and m.state("r") is None
    assert m.anomalies == [("forced", "request_id", "r", "abort")]


# -- the driver calls the oracle prescribes, pinned to DESIGN.md on their own ----------


def calls(out: object) -> list[tuple[str, bool]]:
    return [(c.action, c.raised) for c in out.calls]  # type: ignore[attr-defined]


def test_a_transition_calls_do_then_acquires_then_the_derived_releases_with_the_key_only() -> None:
    m = model()
    begin = m.begin("r")
    assert begin.calls == [Call("alloc_gpu_blocks", "r"), Call("alloc_host_buf", "r")]
    assert calls(m.fire("r", "start")) == [("start_transfer", False), ("take_lease", False), ("free_host_buf", False)]
    # releases in the source's holds order: transferring holds [gpu_blocks, lease]
    assert calls(m.fire("r", "complete")) == [
        ("finish_transfer", False),
        ("free_gpu_blocks", False),
        ("drop_lease", False),
    ]


def test_a_failed_begin_undoes_the_acquires_it_made() -> None:
    m = model()
    m.inject("alloc_host_buf")
    assert calls(m.begin("r")) == [("alloc_gpu_blocks", False), ("alloc_host_buf", True), ("free_gpu_blocks", False)]


def test_a_failed_acquire_fires_on_error_from_the_source_and_releases_what_that_path_releases() -> None:
    m = model()
    m.begin("r")
    m.inject("take_lease")
    out = m.fire("r", "start")
    assert calls(out) == [
        ("start_transfer", False),
        ("take_lease", True),
        ("free_gpu_blocks", False),
        ("free_host_buf", False),
    ]
    assert [f.as_tuple() for f in out.failures] == [("r", "start", "take_lease", "acquire", "failed")]


def test_a_raising_release_is_reported_and_the_other_releases_still_run() -> None:
    m = model()
    m.begin("r")
    m.fire("r", "start")
    m.inject("free_gpu_blocks")
    out = m.fire("r", "complete")
    assert calls(out) == [("finish_transfer", False), ("free_gpu_blocks", True), ("drop_lease", False)]
    assert [f.as_tuple() for f in out.failures] == [("r", "complete", "free_gpu_blocks", "release", "done")]
    assert m.state("r") == "done" and m.counts["release_errors"] == 1


def test_a_fault_aimed_at_one_key_spares_the_others() -> None:
    m = model()
    m.inject("alloc_gpu_blocks", key="b")
    assert not m.begin("a").failures
    assert m.begin("b").failures and m.state("b") is None


def test_close_releases_by_force_what_abort_leaves_held() -> None:
    m = model()
    m.begin("r")
    m.fire("r", "start")
    assert calls(m.close()) == [("drop_lease", False), ("free_gpu_blocks", False)]
    assert m.close().calls == []  # a second close does nothing


def test_a_deadline_armed_during_a_poll_waits_for_the_next_poll() -> None:
    m = model()
    m.begin("r")
    m.fire("r", "start")  # transferring: expire due at 5.0, into retrying (give_up after 2.0)
    m.now = 5.0
    assert m.poll(now=100.0).fired == [("r", "expire", "retrying")]
    assert m.poll(now=100.0).fired == [("r", "give_up", "failed")]
