"""The PD abort protocol across processes: the prefill and decode roles, running the role specs the explorer
verified, as :mod:`.prefill` and :mod:`.decode` serve them in processes of their own; :class:`JobConfig` says
how. The job that starts them, injects faults and keeps the ledger is :func:`kvfsm.harness.pd.run_job`.
"""

from .config import BACKENDS, PROTOCOLS, JobConfig

__all__ = ["BACKENDS", "PROTOCOLS", "JobConfig"]
