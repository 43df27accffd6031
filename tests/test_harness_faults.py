"""The one fault plan and the wrappers that apply it (the data plane, driver actions), on the embedded agents.

What a wrapper injects must be what its plan says, decided by key alone (so two processes over one plan agree), and
what reaches the peer must be what was sent, less the lost, plus the duplicated and the malformed.
"""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.drivers.dataplane import TransferError
from kvfsm.drivers.fabric import Fabric
from kvfsm.drivers.moriio.messages import Release, WriteDone, encode, fault_label
from kvfsm.drivers.nixl import notif
from kvfsm.harness import nixl as nixl_faults
from kvfsm.harness.faults import MALFORMED, FaultPlan, FaultyActions, FaultyAgent, InjectedFault

KINDS = ["lost_release", "duplicate_release", "malformed_release", "lost_write_done"]


def pair(plan: FaultPlan) -> tuple[Fabric, FaultyAgent, torch.Tensor, torch.Tensor]:
    fabric = Fabric()
    here, there = fabric.agent("here"), fabric.agent("there")
    mine, theirs = torch.zeros(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8)
    here.register(mine)
    there.register(theirs)
    return fabric, FaultyAgent(here, plan, label=notif.fault_label), mine, theirs


def extent(t: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(t.data_ptr()), t.numel())]


def test_a_plan_refuses_what_no_wrapper_can_inject_and_what_its_protocol_does_not_know() -> None:
    with pytest.raises(ValueError, match=r"unknown faults \['typo'\]"):
        FaultPlan(0.1, ["typo"])
    with pytest.raises(ValueError, match=r"unknown faults \['lost_release'\]; choose from"):
        FaultPlan(0.1, ["lost_release"], known=nixl_faults.FAULTS)
    with pytest.raises(ValueError, match="rate must be within"):
        FaultPlan(1.5, ["raising_read"])
    assert FaultPlan(0.5, []).fault("anything") is None


def test_raising_and_failed_posts_raise_and_nothing_is_left_in_flight() -> None:
    fabric, agent, mine, theirs = pair(FaultPlan(1.0, ["raising_read"]))
    with pytest.raises(TransferError, match="injected failure"):
        agent.post("READ", "there", extent(mine), extent(theirs), notif.encode("p-1", 1))
    fabric, agent, mine, theirs = pair(FaultPlan(1.0, ["failed_read"]))
    with pytest.raises(TransferError, match="not registered"):  # NIXL refuses unregistered memory at the post
        agent.post("READ", "there", extent(mine), extent(theirs), notif.encode("p-1", 1))
    assert agent.injected == {"failed_read": 1}
    assert fabric.agents["here"].live_handles() == 0 and not mine.any()


def test_a_lost_notification_leaves_the_transfer_itself_whole() -> None:
    fabric, agent, mine, theirs = pair(FaultPlan(1.0, ["lost_notif"]))
    handle = agent.post("READ", "there", extent(mine), extent(theirs), notif.encode("p-1", 1))
    assert agent.state(handle) == "DONE" and torch.equal(mine, theirs)
    agent.release(handle)
    assert fabric.agents["there"].notifs() == [] and agent.injected == {"lost_notif": 1}


def test_unlabelled_notifications_pass_untouched() -> None:
    fabric, agent, _, _ = pair(FaultPlan(1.0, ["lost_notif"]))
    agent.send_notif("there", b"no-colon")  # the protocol does not know it: no fault is decided for it
    assert fabric.agents["there"].notifs() == [("here", b"no-colon")] and not agent.injected


@settings(max_examples=60, deadline=None)
@given(
    rate=st.sampled_from([0.0, 0.3, 1.0]),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True),
    ids=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    seed=st.integers(0, 5),
)
def test_what_arrives_is_what_was_sent_less_the_lost_plus_the_repeats(
    rate: float, kinds: list[str], ids: list[int], seed: int
) -> None:
    """Every message of one transfer meets the plan's one fault for that transfer id, whichever side sends it."""
    fabric = Fabric()
    plan = FaultPlan(rate, kinds, seed)
    agent = FaultyAgent(fabric.agent("here"), plan, label=fault_label)
    fabric.agent("there")
    sent = [Release(f"t-{i}") if i % 2 else WriteDone(f"t-{i}") for i in ids]
    for message in sent:
        agent.send_notif("there", encode(message))
    arrived = [raw for _sender, raw in fabric.agents["there"].notifs()]
    expected: list[bytes] = []
    hit: Counter[str] = Counter()
    for message in sent:
        raw, tag = encode(message), "release" if isinstance(message, Release) else "write_done"
        fault = plan.fault(message.transfer_id)
        if fault is not None and fault.endswith(f"_{tag}"):
            hit[fault] += 1
        if fault == f"lost_{tag}":
            continue
        expected.append(raw)
        if fault == f"duplicate_{tag}":
            expected.append(raw)
        elif fault == f"malformed_{tag}":
            expected.append(MALFORMED[zlib.crc32(message.transfer_id.encode()) % len(MALFORMED)])
    assert arrived == expected
    assert agent.injected == hit


def test_faulty_actions_raise_where_the_plan_says_and_pass_everything_else_through() -> None:
    class Driver:
        def __init__(self) -> None:
            self.ran: list[int] = []
            self.other = "kept"

        def send(self, key: int, /, **payload: object) -> None:
            self.ran.append(key)

        def free(self, key: int, /) -> None:
            self.ran.append(-key)

    plan = FaultPlan(0.2, ["raising_send"], seed=3)
    driver = Driver()
    faulty = FaultyActions(driver, plan, ["send"])
    raised = []
    for key in range(500):
        try:
            faulty.send(key, size=1)
        except InjectedFault:
            raised.append(key)
        faulty.free(key + 1)
    assert faulty.injected["raising_send"] == len(raised) == plan.count(f"send/{k}" for k in range(500))["raising_send"]
    assert 60 < len(raised) < 140  # a fifth of 500, give or take
    assert [k for k in driver.ran if k >= 0] == [k for k in range(500) if k not in raised]  # a raise runs nothing
    assert sum(1 for k in driver.ran if k < 0) == 500 and faulty.other == "kept"  # unnamed actions pass through
