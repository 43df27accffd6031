"""An open defect, pinned: MoRIIO WRITE mode's decode side gives an aborted request's blocks back at once.

``write_consumer.yaml`` ends a load on ``abort`` (``aborted`` holds nothing);
the decode side tells the prefill afterwards (``release``), and a prefill
that has its ``remote_blocks`` already writes. Seed 002's merged fix had
the same shape; its correction waits in ``aborting`` for the prefill's
answer (docs/pd_abort.md §3). ``tests/specs/moriio/write_abort.yaml`` adds
that property to the bundled composition, and ``kvfsm explore`` breaks it in
three moves: the consumer announces its blocks, is aborted with its
``remote_blocks`` still on the wire, and the prefill starts writing when it
arrives. The test below asks for the property and is expected to fail until
the consumer waits for the prefill's answer, a ``write_done`` or the
deadline that bounds its writes (``write_by``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm.explore import explore

SYSTEM = Path(__file__).parent / "specs" / "moriio" / "write_abort.yaml"


@pytest.mark.xfail(strict=True, reason="open: the WRITE consumer frees its blocks at abort (docs/moriio.md §5)")
def test_the_write_consumer_keeps_an_aborted_requests_blocks_while_a_write_may_land() -> None:
    (prop,) = [p for p in explore(SYSTEM).properties if p.name == "write_after_free"]
    assert prop.status == "verified", prop.trace and prop.trace.violation

