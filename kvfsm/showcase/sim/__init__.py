"""A small, honest model of vLLM's scheduler step, driving the CPU-offload connector with a workload.

>>> report = simulate(Workload(num_requests=500, seed=1))
>>> report.clean, report.preempted_fraction, report.aborted_mid_load_fraction
"""

from .report import SimReport
from .runner import KVPattern, run_worker
from .scheduler import SimConfig, Simulation, StepOutput, simulate
from .workload import SimRequest, Workload

__all__ = [
    "KVPattern",
    "SimConfig",
    "SimReport",
    "SimRequest",
    "Simulation",
    "StepOutput",
    "Workload",
    "run_worker",
    "simulate",
]
