"""The plain model that generated tests hold the Tracker to (kvfsm.testing.model), and its agreement with the Tracker.

The model is computed from the spec alone; the Tracker compiles the spec into
tables of its own. On a spec that uses every feature the model interprets
(acquires at begin, a timeout with an action into a live state, an on_error
edge with an action of its own, an abort that does not finish), hundreds of
random examples with faults must find no disagreement.
"""

from __future__ import annotations

import pytest
from buggy_drivers import pool_driver

import kvfsm
from kvfsm.testing import Report, SpecModel, run

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
  - {event: fail,     from: [pinned, transferring, retrying, draining], to: failed, do: note_failure}
  - {event: abort,    from: [pinned, retrying], to: aborted}
  - {event: abort,    from: transferring, to: draining}
  - {event: drained,  from: draining,     to: aborted}
ignore:
  - {event: [abort, complete, fail, expire, give_up, drained], in: [done, failed, aborted]}
on_error: fail
""",
    "retrying_send.yaml",
)
"""Deliberately unchecked: on_error runs an action (KVF109) and draining refuses abort (KVF108)."""


@pytest.fixture(scope="module", params=[0, 1])
def agreement(request: pytest.FixtureRequest) -> Report:
    return run(SPEC, pool_driver(SPEC), seed=request.param)


def test_the_model_agrees_with_the_tracker_on_every_feature_it_interprets(agreement: Report) -> None:
    assert agreement.passed, "\n".join(agreement.story) or agreement.error


def test_the_runs_reach_every_feature_the_model_interprets(agreement: Report) -> None:
    cov = agreement.coverage
    taken = cov.taken()
    assert taken["transferring", "expire"] and taken["retrying", "give_up"] and taken["transferring", "abort"]
    assert cov.faults["alloc_gpu_blocks"] + cov.faults["alloc_host_buf"] > 0  # a begin failed: nothing begun
    assert cov.faults["note_failure"] > 0  # the on_error edge's own action raised: taken bare
    assert cov.faults["note_expiry"] > 0  # a timeout's action raised inside poll()
    assert cov.forced > 0  # close() released instances that abort leaves in draining


def model() -> SpecModel:
    return SpecModel(SPEC)


def test_a_fault_in_a_do_action_fires_on_error_from_the_source() -> None:
    m = model()
    m.begin("r")
    m.faults.add("start_transfer")
    out = m.fire("r", "start")
    assert [f.as_tuple() for f in out.failures] == [("r", "start", "start_transfer", "do", "failed")]
    assert [(s.event, s.source, s.target, s.how) for s in out.steps] == [("fail", "pinned", "failed", "on_error")]
    assert m.state("r") == "failed" and not m.faults


def test_a_fault_in_the_on_error_edges_own_action_still_takes_it() -> None:
    m = model()
    m.begin("r")
    m.faults.update({"start_transfer", "note_failure"})
    out = m.fire("r", "start")
    assert [(f.action, f.state) for f in out.failures] == [("start_transfer", "failed"), ("note_failure", "failed")]
    assert m.state("r") == "failed"


def test_a_fault_at_begin_begins_nothing() -> None:
    m = model()
    m.faults.add("alloc_host_buf")
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
    assert m.begin("r").steps  # final but not drained: a new generation
    assert m.drain().drained == [("r", "aborted")]
    assert m.state("r") == "pinned"  # the new instance survives the drain of the old one


def test_close_aborts_and_forces_what_abort_cannot_finish() -> None:
    m = model()
    m.begin("r")
    m.fire("r", "start")
    out = m.close()
    assert [(s.source, s.target) for s in out.steps] == [("transferring", "draining")]
    assert out.forced == ["r"] and m.state("r") is None
    assert m.anomalies == [("forced", "request_id", "r", "abort")]
