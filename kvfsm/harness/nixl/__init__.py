"""The NIXL drivers' harness: prefill ranks with real NIXL agents in a peer process (:mod:`.peer`), and a decode
rank's agent behind faults (:func:`faulty`)."""

from __future__ import annotations

from collections.abc import Sequence

from ...drivers.dataplane import DataPlane
from ...drivers.nixl.notif import fault_label
from ..faults import FaultPlan, FaultyAgent

FAULTS = ("raising_read", "lost_notif", "duplicate_notif", "malformed_notif")
"""The faults a decode rank's agent meets in the NIXL tests and soaks (:class:`~kvfsm.harness.faults.FaultyAgent`): a
READ whose post raises, and a notification lost, sent twice, or followed by bytes that do not parse."""


def faulty(agent: DataPlane, rate: float, seed: int = 0, faults: Sequence[str] = FAULTS) -> FaultyAgent:
    """``agent`` with a fraction ``rate`` of its requests hit by one of ``faults`` (:data:`FAULTS` by default),
    decided per request id: the READ's post raising, or its notifications lost, sent twice or followed by bytes
    that do not parse."""
    return FaultyAgent(agent, FaultPlan(rate, faults, seed, known=FAULTS), label=fault_label)


__all__ = ["FAULTS", "faulty"]
