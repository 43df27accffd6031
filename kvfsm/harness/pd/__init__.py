"""The P/D job (:func:`run_job`): a prefill and a decode process on loopback running the role specs the explorer
verified with the drivers of :mod:`kvfsm.drivers.pd`, joined by pyzmq control messages (:mod:`kvfsm.wire`) and the
data plane (embedded shared memory, or the Mooncake TransferEngine), with faults injected and the prefill killed and
restarted; it returns the :class:`Ledger`. :class:`JobConfig` says how. docs/demo.md describes the processes and how
to read the ledger; docs/wire.md the messages.
"""

from .config import BACKENDS, PROTOCOLS, JobConfig
from .job import Ledger, Progress, run_job

__all__ = ["BACKENDS", "PROTOCOLS", "JobConfig", "Ledger", "Progress", "run_job"]
