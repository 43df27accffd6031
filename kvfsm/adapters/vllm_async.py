"""The base of the connectors that move a request's blocks whole, between vLLM's steps (Mooncake store, NIXL,
MoRIIO): nothing happens per layer, and the worker hands vLLM what finished and the blocks a load did not fill."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from ..drivers.report import Finished

VLLM = "vllm"
"""The pool holder of every block of a worker: vLLM's allocator owns them; the connector's holds and pins sit on top."""

Meta = TypeVar("Meta")


class AsyncConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's per-layer hooks as no-ops, and the hand-over of what a worker step finished."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._invalid: set[int] = set()
        """Blocks loads did not fill, until vLLM asks (``get_block_ids_with_load_errors``)."""

    def _step_metadata(self, kind: type[Meta]) -> Meta:
        """This step's metadata from the scheduler side, which must be this connector's ``kind``."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, kind):
            raise TypeError(f"expected {kind.__name__}, got {type(meta).__name__}")
        return meta

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing per layer: a request runs only after its whole load is reported."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: a finished request's blocks move whole."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: vLLM keeps a held request's blocks until finished_sending."""

    def _hand_over(self, done: Finished) -> tuple[set[str] | None, set[str] | None]:
        """``get_finished``'s answer from a worker step's ``done``; its unfilled blocks wait for vLLM to ask."""
        self._invalid |= done.invalid_blocks
        return _ids(done.sending), _ids(done.recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid


def _ids(ids: set[Hashable]) -> set[str] | None:
    return {str(i) for i in ids} or None
