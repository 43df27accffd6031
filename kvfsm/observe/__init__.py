"""Production observability generated from the spec: metrics, a bounded state dump, stuck warnings, a debug endpoint.

Everything here is read from a running :class:`~kvfsm.Tracker` and its spec;
nothing is written per connector. Metrics need the ``kvfsm[metrics]`` extra
(prometheus_client); the dump and the endpoint need nothing.
"""

from .dump import state_dump
from .endpoint import DebugServer, serve
from .outcomes import drain_outcomes
from .stuck import StuckWatch

__all__ = ["DebugServer", "StuckWatch", "drain_outcomes", "serve", "state_dump"]
