"""Model-based tests of the Mooncake store drivers, generated from their specs, on the real master too.

``kvfsm.testing`` builds a Hypothesis state machine from each spec; the
machines here add the two rules a connector really runs (the scheduler saving
a job, the sending or load thread working through one) so that the store
calls themselves are exercised, not only the refusals and aborts around them,
and one invariant over the whole pool and queue. The drivers are the real
ones (:mod:`kvfsm.showcase.mooncake_modeltest` only plans jobs begun without a
payload and injects faults into the store calls behind the actions).

The pre-fix copy of the sender (releases on the success path only, seed 000)
must fail the same machine.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test
from mooncake_fixtures import (  # noqa: F401
    Backend,
    PreFixModelSender,
    backend_fixture,
    mooncake_master_fixture,
    real_store_fixture,
)

import kvfsm.testing
from kvfsm.drivers.mooncake import bundled_spec
from kvfsm.drivers.mooncake.store import KVStore
from kvfsm.showcase.mooncake_modeltest import (
    BLOCKS_PER_JOB,
    ModelLoader,
    ModelRequests,
    ModelSender,
    loader_factory,
    registered_kv,
    sender_factory,
)
from kvfsm.testing import SpecMachine, SpecViolation

SEND = bundled_spec("mooncake_store_send.yaml")
LOAD = bundled_spec("mooncake_store_load.yaml")
EXAMPLES = 60
RUN = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def in_states(machine: SpecMachine, *states: str) -> list[str]:
    return [k for k in machine.keys if machine.model.state(k) in states]


def startable(machine: SpecMachine) -> list[str]:
    """Keys with no instance, or a finished one: where the scheduler can begin a job."""
    return [k for k in machine.keys if machine.model.state(k) is None or machine.model.is_final(k)]


fault = st.sampled_from([None, None, None, 0])
"""Now and then, make the step's first faultable action raise (through the store call behind it)."""


def send_machine(factory: Callable[[], ModelSender]) -> type[SpecMachine]:
    base = kvfsm.testing.spec_machine(SEND, factory)

    class SendMachine(base):  # type: ignore[valid-type,misc]
        @precondition(lambda self: not self.model.closed and bool(startable(self)))
        @rule(data=st.data(), f=fault)
        def scheduler_saves_a_job(self, data: st.DataObject, f: int | None) -> None:
            key = data.draw(st.sampled_from(startable(self)), label="job")
            self.begin(key)
            if self.model.state(key) == "pinned":
                self.fire(key, "enqueue", f)

        @precondition(lambda self: not self.model.closed and bool(in_states(self, "queued", "checked")))
        @rule(data=st.data(), check_fault=fault, put_fault=fault)
        def sending_thread_runs_a_job(
            self, data: st.DataObject, check_fault: int | None, put_fault: int | None
        ) -> None:
            key = data.draw(st.sampled_from(in_states(self, "queued", "checked")), label="job")
            if self.model.state(key) == "queued":
                self.fire(key, "check", check_fault)
            if self.model.state(key) == "checked":
                self.fire(key, "put", put_fault)

        @invariant()
        def pool_and_queue_hold_exactly_the_live_pins_and_tasks(self) -> None:
            d: ModelSender = self.driver
            pinned = in_states(self, "pinned", "queued", "checked")
            holders = {h for b in range(d.pool.num_blocks) for h in d.pool.holders(b)}
            assert holders == {d.holder(k) for k in pinned}, f"pool holders {holders}, live jobs {pinned}"
            assert d.pool.num_free == d.pool.num_blocks - BLOCKS_PER_JOB * len(pinned)
            assert d.queue.unfinished_tasks == len(in_states(self, "queued", "checked"))
            assert d.pool.refused_releases == 0

    return SendMachine


def load_machine(factory: Callable[[], ModelLoader]) -> type[SpecMachine]:
    base = kvfsm.testing.spec_machine(LOAD, factory)

    class LoadMachine(base):  # type: ignore[valid-type,misc]
        @precondition(lambda self: not self.model.closed and bool(startable(self)))
        @rule(data=st.data(), f=fault)
        def scheduler_looks_up_and_allocates(self, data: st.DataObject, f: int | None) -> None:
            key = data.draw(st.sampled_from(startable(self)), label="load")
            self.begin(key)
            self.fire(key, "lookup", f)
            if self.model.state(key) == "found":
                self.fire(key, data.draw(st.sampled_from(["allocate", "allocate", "miss"]), label="then"))

        @precondition(lambda self: not self.model.closed and bool(in_states(self, "queued")))
        @rule(data=st.data(), f=fault)
        def load_thread_runs_a_load(self, data: st.DataObject, f: int | None) -> None:
            self.fire(data.draw(st.sampled_from(in_states(self, "queued")), label="load"), "load", f)

        @invariant()
        def pool_and_queue_hold_exactly_the_live_loads(self) -> None:
            d: ModelLoader = self.driver
            queued = in_states(self, "queued")
            holders = {h for b in range(d.pool.num_blocks) for h in d.pool.holders(b)}
            ordered = {d.scheduler_holder(k) for k in in_states(self, "ordered", "checked")}  # the request's own
            assert holders == {d.holder(k) for k in queued} | ordered
            assert d.queue.unfinished_tasks == len(queued)
            assert d.pool.refused_releases == 0

    return LoadMachine


def taken(machine: type[SpecMachine], source: str, event: str) -> int:
    return sum(n for (s, e, _how), n in machine.coverage.edges.items() if (s, e) == (source, event))


def test_the_sender_passes_its_model_test_with_store_faults(backend: Backend) -> None:
    machine = send_machine(sender_factory(backend.store))
    run_state_machine_as_test(machine, settings=RUN)
    for source, event in [("queued", "check"), ("checked", "put"), ("queued", "fail"), ("checked", "fail")]:
        assert taken(machine, source, event), f"the run never took {source} -{event}->"
    assert machine.coverage.faults["check_exists"] and machine.coverage.faults["put_blocks"]


def test_the_loader_passes_its_model_test_with_store_faults(backend: Backend) -> None:
    machine = load_machine(loader_factory(backend.store))
    run_state_machine_as_test(machine, settings=RUN)
    for source, event in [("new", "lookup"), ("queued", "load"), ("queued", "fail"), ("found", "miss")]:
        assert taken(machine, source, event), f"the run never took {source} -{event}->"
    assert machine.coverage.faults["load_into_blocks"] and machine.coverage.faults["lookup_keys"]


def test_the_pre_fix_sender_fails_its_model_test(backend: Backend) -> None:
    kv = registered_kv(backend.store)
    machine = send_machine(lambda: PreFixModelSender(backend.store, kv))
    quick = settings(RUN, phases=[Phase.explicit, Phase.generate])  # the failure, not its shrinking
    with pytest.raises(SpecViolation) as failed:
        run_state_machine_as_test(machine, settings=quick)
    assert "still held" in str(failed.value)


def test_kvfsm_test_runner_passes_the_plain_generated_machines(backend: Backend) -> None:
    """``kvfsm test``'s own machine (no extra rules) agrees too, for both specs."""
    for spec, factory in [(SEND, sender_factory(backend.store)), (LOAD, loader_factory(backend.store))]:
        report = kvfsm.testing.run(spec, factory, examples=15, seed=5)
        assert report.passed, "\n".join(report.story) or report.error


def test_kvfsm_test_catches_a_sender_that_forgets_a_failed_jobs_release(backend: Backend) -> None:
    """Seed 000's driver (a failed job keeps its pin) through ``kvfsm test``'s own runner, as a user runs it."""
    kv = registered_kv(backend.store)
    report = kvfsm.testing.run(SEND, lambda: PreFixModelSender(backend.store, kv), examples=30, seed=0)
    assert not report.passed
    assert any("still held" in line for line in report.story), "\n".join(report.story) or report.error


def test_the_pre_fix_sender_diverges_where_batch_is_exist_raises(backend: Backend) -> None:
    """Seed 000 step by step through the generated machine: the check raises, the job fails, the pin stays."""
    kv = registered_kv(backend.store)
    machine = send_machine(lambda: PreFixModelSender(backend.store, kv))()
    machine.begin("req-1")
    machine.fire("req-1", "enqueue")
    machine.fire("req-1", "check", 0)  # the store's batch_is_exist fails; the spec says: failed, all released
    assert machine.model.state("req-1") == "failed"
    with pytest.raises(SpecViolation) as failed:
        machine.agrees_with_spec()
    assert "block_pin, queue_task still held by req-1 (req-1 is failed, which holds nothing)" in str(failed.value)


# -- the request and its store jobs, tested together (owns:) ------------------------------------------

REQUEST = bundled_spec("mooncake_store_request.yaml")


class ReportsRequestOnFailure(ModelSender):
    """A sender written by hand the other way round from seed 000: when one of a request's store jobs fails, it
    reports the request in finished_sending at once, and vLLM frees blocks the request's other jobs still pin."""

    def __init__(self, requests: ModelRequests, store: KVStore, kv: torch.Tensor) -> None:
        super().__init__(store, kv)
        self.requests = requests
        self.by: dict[Hashable, Hashable] = {}

    def pin_blocks(self, job: Hashable, /, request_id: Hashable = None, **plan: Any) -> None:
        super().pin_blocks(job, request_id, **plan)
        self.by[job] = request_id

    def check_exists(self, job: Hashable, /) -> None:
        try:
            super().check_exists(job)
        except Exception:
            self.requests.report.send(self.by[job])
            raise


def test_kvfsm_test_runs_a_request_with_its_store_jobs(backend: Backend) -> None:
    """The request's driver and its jobs' real sender, with the family's rules, faults in the store calls and one
    job failing while another is in flight: every request edge taken, what the jobs did reported."""
    kv = registered_kv(backend.store)
    report = kvfsm.testing.run(
        REQUEST, ModelRequests, owned=(SEND, lambda _requests: ModelSender(backend.store, kv)), examples=60, seed=3
    )
    assert report.passed, "\n".join(report.story) or report.error
    assert report.owned is not None and report.owned.faults["check_exists"] and report.owned.faults["put_blocks"]


def test_kvfsm_test_catches_a_sender_that_reports_its_request_at_the_first_failed_job(backend: Backend) -> None:
    kv = registered_kv(backend.store)
    report = kvfsm.testing.run(
        REQUEST,
        ModelRequests,
        owned=(SEND, lambda requests: ReportsRequestOnFailure(requests, backend.store, kv)),
        examples=60,
        seed=3,
    )
    assert not report.passed
    assert report.problems[0] == "observe says send_report not held by req-1 (req-1 is finishing, which holds send_report)"
    assert "check_exists() raised (injected fault)" in report.story[-1], "\n".join(report.story)
    assert "is in flight" in report.found_by
