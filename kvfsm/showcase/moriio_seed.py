"""Seed 001 as drivers: vLLM's MoRIIO connector before #40344, kept to show what kvfsm makes of it. Not for use.

Before the fix a MoRIIO prefill freed a request's blocks only when its
transfer id reached ``done_req_ids``, and only a ``Succeeded()`` status put it
there: a failed or raising write was never marked done. A deferred write task
waited for ``remote_blocks`` with no deadline, and ``status.Wait()`` had none
either; in READ mode a failed read was only logged, so the prefill was never
sent ``release``. At concurrency >= 128 (1P1D) the leaked blocks exhausted the
prefill's pool and the server hung.

Here that is the correct drivers with those lines changed, run by the spec
of the same shape (``specs/moriio/*_pre_fix.yaml``, which ``kvfsm check``
rejects with KVF107; :func:`pre_fix_spec` loads it anyway, as the engine runs
any well-formed spec).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ..drivers.moriio.consumer import BlockReader
from ..drivers.moriio.producer import BlockWriter
from ..drivers.moriio.specs import FOLDER
from ..spec import Spec, well_formed
from ..spec.loader import read
from .moriio_modeltest import ModelReader, ModelWriter

PRE_FIX = {
    "write_producer": "write_producer_pre_fix.yaml",
    "read_producer": "read_producer_pre_fix.yaml",
    "read_consumer": "read_consumer_pre_fix.yaml",
}


PRE_FIX_PREFILL = "kvfsm.showcase.moriio_seed:pre_fix_prefill"
"""Seed 001's prefill as the MoRIIO load runner's ``prefill=`` names it (``kvfsm.harness.moriio.cluster``)."""


def pre_fix_prefill(mode: str) -> dict[str, Any]:
    """The pre-fix prefill's spec and, in WRITE mode, its driver: the arguments of a ``PrefillEngine``."""
    return {"spec": pre_fix_spec(f"{mode}_producer"), "driver": PreFixWriter if mode == "write" else None}


def pre_fix_spec(name: str) -> Spec:
    """The pre-fix shape of ``name``: well formed, but with the KVF107 errors ``kvfsm.load`` would refuse."""
    if name not in PRE_FIX:
        raise ValueError(f"no pre-fix MoRIIO spec {name!r}; choose from {sorted(PRE_FIX)}")
    return well_formed(read(FOLDER / PRE_FIX[name]))


class FreesOnSuccessOnly:
    """The pre-fix release: blocks are freed and reported (finished_sending) only for a transfer whose writes all
    succeeded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written: set[Hashable] = set()

    def notify_write_done(self, key: Hashable, /) -> None:
        super().notify_write_done(key)  # type: ignore[misc]
        self.written.add(key)

    def report_sent(self, key: Hashable, /) -> None:
        if key in self.written:  # released before free_blocks (holds order)
            super().report_sent(key)  # type: ignore[misc]

    def free_blocks(self, key: Hashable, /) -> None:
        if key in self.written:
            self.written.discard(key)
            super().free_blocks(key)  # type: ignore[misc]
        # else: no Succeeded() status, so the transfer id never reaches done_req_ids: the hold stays, unreported


class ReleasesOnSuccessOnly:
    """The pre-fix READ consumer: ``release`` goes to the prefill only after a read that succeeded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.succeeded: set[Hashable] = set()

    def verify_blocks(self, key: Hashable, /) -> None:
        super().verify_blocks(key)  # type: ignore[misc]
        self.succeeded.add(key)

    def send_release(self, key: Hashable, /) -> None:
        if key in self.succeeded:
            self.succeeded.discard(key)
            super().send_release(key)  # type: ignore[misc]
        # else: "read failed" is only logged; the debt stays unpaid


class PreFixWriter(FreesOnSuccessOnly, BlockWriter):
    """The WRITE producer before the fix."""


class PreFixReader(ReleasesOnSuccessOnly, BlockReader):
    """The READ consumer before the fix."""


class PreFixModelWriter(FreesOnSuccessOnly, ModelWriter):
    """:class:`PreFixWriter` set up for a generated model-based test."""


class PreFixModelReader(ReleasesOnSuccessOnly, ModelReader):
    """:class:`PreFixReader` set up for a generated model-based test."""
