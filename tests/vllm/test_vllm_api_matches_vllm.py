"""kvfsm's vLLM-shaped types (``kvfsm.adapters.vllm_api``, for use without vLLM) against vLLM's real classes."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed: ./dev.sh setup installs it")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole as VllmRole
from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
from vllm.v1.outputs import KVConnectorOutput as VllmOutput
from vllm.v1.request import RequestStatus as VllmStatus

from kvfsm.adapters import vllm_api
from kvfsm.showcase.sim.real import make_request


def test_request_status_has_vllms_members_in_vllms_order() -> None:
    assert [(s.name, s.value) for s in vllm_api.RequestStatus] == [(s.name, s.value) for s in VllmStatus]


def test_connector_roles_match() -> None:
    assert {r.name: r.value for r in vllm_api.KVConnectorRole} == {r.name: r.value for r in VllmRole}


def test_every_connector_output_field_is_one_of_vllms_with_its_default() -> None:
    ours = {f.name: f for f in dataclasses.fields(vllm_api.KVConnectorOutput)}
    theirs = {f.name: f for f in dataclasses.fields(VllmOutput)}
    assert set(ours) <= set(theirs), set(ours) - set(theirs)
    for name, field in ours.items():
        assert (field.default, field.default_factory) == (theirs[name].default, theirs[name].default_factory), name


def test_vllms_request_has_what_the_request_protocol_reads() -> None:
    request = make_request("r", list(range(40)), max_tokens=1, block_size=16)
    for name in ("request_id", "status", "num_tokens", "num_computed_tokens", "block_hashes"):
        assert hasattr(request, name), name
    assert len(request.block_hashes) == 2


def test_vllms_scheduler_output_has_what_build_connector_meta_reads() -> None:
    names = {f.name for f in dataclasses.fields(VllmSchedulerOutput)}
    assert {"finished_req_ids", "preempted_req_ids"} <= names
