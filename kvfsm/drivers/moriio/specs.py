"""The bundled MoRIIO specs (``kvfsm/specs/moriio/``), loaded once."""

from __future__ import annotations

from functools import cache

from ...spec import Spec, load
from ...spec.bundled import SPECS

FOLDER = SPECS / "moriio"
TRANSFER_ID = "transfer_id"
"""The id space both engines share; every MoRIIO message is routed by it, never by an engine's request id."""

MACHINES = ("write_producer", "write_consumer", "read_producer", "read_consumer")


@cache
def moriio_spec(name: str) -> Spec:
    """``kvfsm/specs/moriio/<name>.yaml``, checked (one of :data:`MACHINES`)."""
    if name not in MACHINES:
        raise ValueError(f"no MoRIIO spec {name!r}; choose from {MACHINES}")
    return load(FOLDER / f"{name}.yaml")
