"""A NIXL READ whose handle was released can still write the initiator's memory (docs/nixl.md §6, a known hazard).

The short version of ``benchmarks/nixl_release_in_flight.py``: real agents in
two processes on loopback, ``UCX_TLS=tcp`` (the data path then needs the
target's progress, as over a network without RDMA; UCX's default on one host
copies the bytes one-sided with CMA before anything can be released). The
prefill peer is SIGSTOPped, the READ posted, seen ``PROC``, released, the
destination overwritten (a new owner's bytes), the peer SIGCONTed. The
decode driver unpins ``dst_blocks`` right after ``release_reads``, which is
safe only if a released READ never lands: it does, so the test is an
``xfail(strict=True)`` until the driver holds the blocks past the release.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("nixl", reason="needs the nixl wheels: pip install 'kvfsm[nixl]'")
pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "nixl_release_in_flight.py"


def _bench() -> ModuleType:
    name = "nixl_release_in_flight"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.nixl
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known hazard: release_xfer_handle on a PROC READ does not stop it; after SIGCONT it writes the "
    "destination the decode driver has already unpinned (docs/nixl.md §6, a known hazard)",
)
def test_nixl_release_a_released_read_never_writes_the_destination(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by each agent at creation; the peer process inherits it
    m = _bench().measure(1, 1 << 20, 0, 0.5, ["stopped", "kept"], "tcp", notif_wait=0.3)
    released, kept = m.trials
    # What makes the measurement mean something: a failure here is not the hazard, and is not xfailed.
    if released.state_at_release != "PROC" or released.released != "ok" or released.before != 0:
        pytest.fail(f"the READ was not held by the stopped peer, or release_xfer_handle refused it: {released}")
    if kept.after != kept.size:
        pytest.fail(f"the control READ (not released) did not land after SIGCONT: {kept}")
    assert released.after == 0, (
        f"{released.after} of {released.size} bytes of the released READ landed after release_xfer_handle, "
        f"over the bytes written there after the release (notification reached the prefill: {released.notif})"
    )
