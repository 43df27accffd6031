"""Params: relations declared in the spec, and where each value comes from (Tracker, environment, spec)."""

from __future__ import annotations

import logging
from collections.abc import Hashable

import pytest

import kvfsm
from kvfsm import BindingError, Tracker
from kvfsm.engine.params import env_name
from kvfsm.spec import read_text

SPEC = """
kvfsm: 1
machine: leased_send
key: request_id
params: {transfer_timeout: 30.0, lease_ttl: 40.0}
relations:
  - lease_ttl > transfer_timeout + 5
  - transfer_timeout >= 1
resources:
  blocks: {release: free_blocks}
states:
  sending: {initial: true, holds: [blocks], timeout: {after: transfer_timeout, fire: expire}}
  done:    {final: success}
  failed:  {final: failure}
transitions:
  - {event: complete, from: sending, to: done}
  - {event: expire,   from: sending, to: failed}
  - {event: abort,    from: "*",     to: failed}
"""


class Driver:
    def free_blocks(self, key: Hashable) -> None: ...


def test_relations_are_read_and_hold_for_the_specs_own_values() -> None:
    spec = kvfsm.parse(SPEC, "leased.yaml")
    assert [r.text for r in spec.relations] == ["lease_ttl > transfer_timeout + 5", "transfer_timeout >= 1"]
    assert spec.broken_relations() == []
    assert [r.text for r in spec.broken_relations({"transfer_timeout": 36.0})] == ["lease_ttl > transfer_timeout + 5"]


def test_an_override_that_breaks_a_relation_is_a_binding_error_naming_it_and_the_values() -> None:
    spec = kvfsm.parse(SPEC, "leased.yaml")
    with pytest.raises(
        BindingError,
        match=r"'lease_ttl > transfer_timeout \+ 5' declared at leased.yaml:7.*lease_ttl = 40, transfer_timeout = 60",
    ):
        Tracker(spec, Driver(), params={"transfer_timeout": 60.0})


@pytest.mark.parametrize(
    ("relation", "message"),
    [
        ("lease_ttl >> transfer_timeout", "is not 'left <op> right'"),
        ("lease_ttl > transfer_timeout - 5", "is not a param, a number or 'number * param'"),
    ],
)
def test_a_malformed_relation_is_kvf001_with_a_fix(relation: str, message: str) -> None:
    text = SPEC.replace("lease_ttl > transfer_timeout + 5", relation)
    with pytest.raises(kvfsm.SpecError) as caught:
        read_text(text, "bad.yaml")
    (finding,) = caught.value.findings
    assert finding.code == "KVF001" and message in finding.message and finding.line == 7 and finding.fix


def test_a_relation_naming_an_undeclared_param_is_kvf106() -> None:
    findings = kvfsm.spec.run_checks(read_text(SPEC.replace("lease_ttl > transfer", "lease > transfer"), "x.yaml"))
    assert [(f.code, f.line) for f in findings] == [("KVF106", 7)]


def test_each_param_says_where_it_came_from_and_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = kvfsm.parse(SPEC, "leased.yaml")
    monkeypatch.setenv(env_name("leased_send", "lease_ttl"), "50")
    assert env_name("leased_send", "lease_ttl") == "KVFSM_LEASED_SEND_LEASE_TTL"
    with caplog.at_level(logging.INFO, logger="kvfsm.params"):
        t = Tracker(spec, Driver(), params={"transfer_timeout": 20.0})
        Tracker(spec, Driver(), params={"transfer_timeout": 20.0})
    assert t.params["transfer_timeout"] == (20.0, "Tracker(params=...)")
    assert t.params["lease_ttl"] == (50.0, "environment KVFSM_LEASED_SEND_LEASE_TTL")
    assert t.timeout("sending") == 20.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "lease_ttl = 50 (environment KVFSM_LEASED_SEND_LEASE_TTL)" in lines[0]


def test_an_environment_value_that_is_no_deadline_is_a_binding_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVFSM_LEASED_SEND_LEASE_TTL", "soon")
    with pytest.raises(BindingError, match="KVFSM_LEASED_SEND_LEASE_TTL='soon'"):
        Tracker(kvfsm.parse(SPEC, "leased.yaml"), Driver())
