"""The PD abort protocol across processes: prefill and decode running the role specs the explorer verified.

:func:`run_job` starts a prefill and a decode process on loopback, joined by
pyzmq control messages (:mod:`kvfsm.wire`) and a KV transport (embedded
shared memory, or the Mooncake TransferEngine), injects faults, and returns
the :class:`Ledger`. docs/demo.md describes the processes and how to read the
ledger; docs/wire.md the messages between them.
"""

from .config import BACKENDS, PROTOCOLS, JobConfig
from .job import Ledger, Progress, run_job

__all__ = ["BACKENDS", "PROTOCOLS", "JobConfig", "Ledger", "Progress", "run_job"]
