"""One P/D job's settings, shared by the coordinator and the prefill and decode processes it starts."""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOLS = ("corrected", "merged_fix")
"""The role specs a job runs: ``specs/pd_abort/{prefill,decode}_<protocol>.yaml``."""
BACKENDS = ("embedded", "real")
"""``embedded``: decode's pages in a shared-memory file prefill writes directly; ``real``: Mooncake TransferEngine."""


@dataclass(frozen=True)
class JobConfig:
    """Everything both processes must agree on; picklable, so it crosses the spawn."""

    requests: int = 1000
    concurrency: int = 64
    fault_rate: float = 0.1
    seed: int = 0
    protocol: str = "corrected"
    backend: str = "embedded"
    pages_per_room: int = 4
    chunk_pages: int = 2
    page_elems: int = 256
    decode_port: int = 0
    prefill_port: int = 0
    shared_path: str = ""
    # times, in seconds: the protocol's timeouts (spec params) and the simulated work
    waiting_timeout: float = 1.0
    ack_timeout: float = 0.1
    bootstrap_timeout: float = 10.0
    prefill_bootstrap_timeout: float = 2.0
    transfer_timeout: float = 5.0
    forward_time: tuple[float, float] = (0.0005, 0.002)
    chunk_time: tuple[float, float] = (0.002, 0.010)
    slow_write_time: tuple[float, float] = (0.020, 0.060)
    decode_time: tuple[float, float] = (0.010, 0.030)
    abort_within: float = 0.025
    deadline: float = 50.0
    """Decode gives up on the job once no request has ended for this long (a stall, not the job's length, so
    any number of requests runs); whatever is still live then is counted as hung."""
    metrics: bool = False
    """Each process serves its trackers' state and metrics on 127.0.0.1 (kvfsm.observe); URLs in the ledger."""
    metrics_port: int = 0
    """With ``metrics``: prefill serves on this port and decode on the next, the same across a restart of either
    (0: any free port, a new one at each start)."""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol {self.protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError("requests and concurrency must be at least 1")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault rate {self.fault_rate} is not a probability (0 to 1)")
        if self.pages_per_room % self.chunk_pages:
            raise ValueError("pages_per_room must be a multiple of chunk_pages")
        if self.slow_write_time[1] * 10 > self.transfer_timeout:
            raise ValueError(
                "transfer_timeout must exceed ten slow writes: a write still in flight when it fires would land in freed pages"
            )

    @property
    def decode_pages(self) -> int:
        """Exactly what ``concurrency`` rooms hold: a freed page is taken again at once, as in a busy server."""
        return self.concurrency * self.pages_per_room

    @property
    def prefill_pages(self) -> int:
        return 2 * self.concurrency * self.pages_per_room
