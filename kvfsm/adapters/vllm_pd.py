"""The base of the P/D connectors (NIXL, MoRIIO): a worker is a prefill and/or a decode rank, each a driver whose
Tracker holds what the rank owes, stepped once per vLLM step; a decode request loads its whole prompt."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ..drivers.report import Finished
from ..engine import Tracker
from .vllm_api import RequestStatus
from .vllm_async import AsyncConnector


class Rank(Protocol):
    """What the base needs of a rank's driver (NIXL's ranks, MoRIIO's engines)."""

    @property
    def tracker(self) -> Tracker: ...

    def step(self, now: float | None = None) -> Finished: ...


Prefill = TypeVar("Prefill", bound=Rank)
Decode = TypeVar("Decode", bound=Rank)
Handshake = TypeVar("Handshake")


class PDConnector(AsyncConnector, Generic[Prefill, Decode]):
    """The scheduler's answer for a decode request, and a worker's ranks stepped, counted and closed."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = self._kv_transfer_config
        self.engine_id = str(config.engine_id)
        self.kv_role = str(config.kv_role)
        self.prefill: Prefill | None = None
        self.decode: Decode | None = None
        """This worker's ranks by ``kv_role`` (none on the scheduler side)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """With ``do_remote_prefill``: every prompt token not computed locally, loaded asynchronously."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """One step of each rank (messages, transfers, deadlines): finished_sending from the prefill rank,
        finished_recving and the blocks to recompute from the decode rank."""
        done = Finished()
        if self.prefill is not None:
            done.sending = self.prefill.step().sending
        if self.decode is not None:
            loaded = self.decode.step()
            done.recving, done.invalid_blocks = loaded.recving, loaded.invalid_blocks
        return self._hand_over(done)

    def live(self) -> int:
        """Tracker instances still live on this worker's ranks (0 once every hold and every load is over)."""
        return sum(rank.tracker.live() for rank in self._ranks())

    def _close_ranks(self) -> None:
        """Abort everything the ranks still hold: every release runs."""
        for rank in self._ranks():
            rank.tracker.close()

    def _ranks(self) -> list[Rank]:
        return [rank for rank in (self.prefill, self.decode) if rank is not None]


def held_for_decode(request: Any) -> bool:
    """A prefill request whose blocks wait for the decode side: ``do_remote_decode``, and vLLM ended it at its
    length."""
    params = request.kv_transfer_params or {}
    return bool(params.get("do_remote_decode")) and request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def handshakes(metadata: Mapping[int, Any], kind: type[Handshake]) -> Iterator[tuple[int, Handshake]]:
    """The workers' ``get_handshake_metadata`` by rank, in rank order, without the ranks that sent none; another
    connector's is a TypeError."""
    for rank, meta in sorted(metadata.items()):
        if meta is None:
            continue
        if not isinstance(meta, kind):
            raise TypeError(f"rank {rank}'s handshake metadata is a {type(meta).__name__}, not {kind.__name__}")
        yield rank, meta


def tp_rank(configured: int | None) -> int:
    """This worker's tensor-parallel rank: ``tp_rank`` of the extra config, else vLLM's (0 when vLLM's
    distributed state is not set up)."""
    if configured is not None:
        return configured
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):
        return 0
