"""What a simulation run did, and whether it ended clean."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...adapters.vllm_cpu_offload import ConnectorStats


@dataclass
class SimReport:
    """Counts from one run. ``clean`` is the verdict: no leak, no stale byte, no assertion vLLM would hit."""

    seed: int
    steps: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    aborted_mid_load: int = 0
    """Aborted while vLLM held them in WAITING_FOR_REMOTE_KVS (their load in flight)."""
    preempted: int = 0
    """Requests preempted at least once (vLLM makes no connector call for it)."""
    preemptions: int = 0
    alloc_failures_after_hit: int = 0
    """allocate_slots failed after phase A had pinned a CPU hit (no connector call either)."""
    loads_checked: int = 0
    """Loads whose GPU blocks were compared with the bytes their prefix hashes name."""
    loads_recomputed: int = 0
    """Loads that failed and that the scheduler recomputed from the first bad block."""
    stale_blocks: int = 0
    """Loaded GPU blocks whose bytes were not the ones stored for their prefix."""
    cpu_cache_mismatches: int = 0
    """Published CPU blocks whose bytes were not the ones their hash names (checked at the end)."""
    failed_copies: int = 0
    lost_reports: int = 0
    duplicated_outputs: int = 0
    late_outputs: int = 0
    cpu_evictions: int = 0
    assertion_failures: list[str] = field(default_factory=list)
    """Checks vLLM's scheduler makes with ``assert`` that would have failed."""
    connector: ConnectorStats = field(default_factory=ConnectorStats)
    anomalies: dict[str, int] = field(default_factory=dict)
    """Reports the trackers dropped: late, duplicate or unknown job ids."""
    leaked_cpu_refs: dict[int, int] = field(default_factory=dict)
    leaked_gpu_refs: dict[int, int] = field(default_factory=dict)
    live_instances: int = 0
    unfinished_requests: int = 0
    wall_seconds: float = 0.0

    @property
    def preempted_fraction(self) -> float:
        return self.preempted / self.requests if self.requests else 0.0

    @property
    def aborted_mid_load_fraction(self) -> float:
        return self.aborted_mid_load / self.requests if self.requests else 0.0

    @property
    def clean(self) -> bool:
        return not (
            self.leaked_cpu_refs
            or self.leaked_gpu_refs
            or self.live_instances
            or self.unfinished_requests
            or self.stale_blocks
            or self.cpu_cache_mismatches
            or self.assertion_failures
        )

    def summary(self) -> str:
        c = self.connector
        lines = [
            f"{self.requests} requests in {self.steps} steps ({self.wall_seconds:.1f} s): {self.finished} finished, "
            f"{self.aborted} aborted ({self.aborted_mid_load} = {self.aborted_mid_load_fraction:.1%} mid-load), "
            f"{self.preempted} preempted ({self.preempted_fraction:.1%}; {self.preemptions} preemptions)",
            f"CPU hits {c.hits} ({c.hit_tokens} tokens), phase-A retries {c.retries}, allocation failures after a hit "
            f"{self.alloc_failures_after_hit}; loads sent {c.loads_sent}, done {c.loads_done}, failed {c.loads_failed}, "
            f"recomputed {self.loads_recomputed}, refused {c.loads_refused}, expired {c.expired}",
            f"stores sent {c.stores_sent}, done {c.stores_done} ({c.blocks_stored} blocks), cut short for room "
            f"{c.stores_without_room}; CPU evictions {self.cpu_evictions}",
            f"faults: {self.failed_copies} failed copies, {self.lost_reports} lost reports, "
            f"{self.duplicated_outputs} duplicated and {self.late_outputs} late worker outputs; dropped by the trackers: "
            f"{self.anomalies}",
            f"checks: {self.loads_checked} loads byte-checked, {self.stale_blocks} stale blocks, "
            f"{self.cpu_cache_mismatches} CPU cache mismatches, {len(self.assertion_failures)} vLLM assertion failures, "
            f"leaked refs CPU {len(self.leaked_cpu_refs)} GPU {len(self.leaked_gpu_refs)}, "
            f"live instances {self.live_instances}, unfinished requests {self.unfinished_requests}",
            f"verdict: {'clean' if self.clean else 'NOT CLEAN'}",
        ]
        return "\n".join(lines)
