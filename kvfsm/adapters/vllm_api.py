"""The slice of vLLM's KV-connector interface a connector touches, as plain types: no vLLM import needed.

Names, fields and conventions follow vLLM v1 (``vllm/v1/request.py``,
``vllm/v1/outputs.py``, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).
vLLM's own objects satisfy these protocols, so a connector written against them
runs inside vLLM unchanged; the simulator (:mod:`kvfsm.showcase.sim`) supplies its own.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class KVConnectorRole(enum.IntEnum):
    """Each connector is built twice: once in the scheduler process, once in every worker."""

    SCHEDULER = 0
    WORKER = 1


class RequestStatus(enum.IntEnum):
    """vLLM's request status; everything after PREEMPTED counts as finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class Request(Protocol):
    """What a connector reads of vLLM's ``Request``."""

    @property
    def request_id(self) -> str: ...
    @property
    def status(self) -> RequestStatus: ...
    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        ...

    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[int]:
        """One prefix hash per *full* block of the request's tokens (vLLM's ``request.block_hashes``)."""
        ...


class KVCacheBlocks(Protocol):
    """The request's GPU blocks, one list per KV-cache group (``get_block_ids()[0]`` for a single group)."""

    def get_block_ids(self) -> tuple[list[int], ...]: ...


class SchedulerOutput(Protocol):
    """What ``build_connector_meta`` reads of the step's scheduler output."""

    @property
    def finished_req_ids(self) -> set[str]: ...
    @property
    def preempted_req_ids(self) -> set[str] | None:
        """Requests preempted this step: the only way a connector learns of a preemption."""
        ...


class KVConnectorMetadata:
    """What the scheduler side sends the worker side each step (vLLM: ``KVConnectorMetadata``)."""


@dataclass
class KVConnectorOutput:
    """The workers' connector results for one step, aggregated (vLLM: ``vllm/v1/outputs.py``).

    ``update_connector_output`` sees it before the scheduler acts on it, and
    may rewrite it (vLLM's MoRIIO connector injects reaped ids the same way).
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)
    expected_finished_count: int = 0
