"""vLLM's KV cache as a connector adopts it: the block layout its ``KVCacheConfig`` describes, and the tensors vLLM
registers read as one :class:`~kvfsm.drivers.kv_cache.KVCache` of that layout. It does not import vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..drivers.kv_cache import KVCache, KVLayout


def layout_of(kv_cache_config: Any, connector: str = "the connector") -> tuple[KVLayout, int]:
    """The KV block layout and GPU block count of vLLM's ``KVCacheConfig`` (one full-attention group);
    ``connector`` names who refuses any other."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"{connector} serves one KV-cache group, this model has {len(groups)}; "
            "run vLLM with disable_hybrid_kv_cache_manager=True or a model with one attention type"
        )
    spec = groups[0].kv_cache_spec
    # A layer's page is K and V (two tensors' worth) for attention, one latent for MLA: vLLM's own page size
    # says which, so the connector's block is exactly the bytes vLLM keeps per block.
    tensor_bytes = (
        spec.block_size * spec.num_kv_heads * spec.head_size * torch.empty((), dtype=spec.dtype).element_size()
    )
    per_layer, rest = divmod(int(spec.page_size_bytes), tensor_bytes)
    if rest or per_layer < 1:
        raise ValueError(
            f"vLLM's page of {spec.page_size_bytes} B is not a whole number of {tensor_bytes} B tensors "
            f"({type(spec).__name__}, padded?): {connector} copies unpadded attention or MLA pages only"
        )
    layout = KVLayout(
        num_layers=per_layer * len(groups[0].layer_names),
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=spec.dtype,
    )
    return layout, int(kv_cache_config.num_blocks)


def adopt_layers(kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any, layout: KVLayout) -> KVCache:
    """vLLM's per-layer tensors (``register_kv_caches``) as one cache, without a copy: each layer's blocks read
    where the ``KVCacheConfig`` placed them."""
    placements = getattr(kv_cache_config, "kv_cache_tensors", None) or ()
    return KVCache.of_layers(kv_caches, int(kv_cache_config.num_blocks), layout, placements)


def adopt_cross_layers(kv_cache: torch.Tensor, layout: KVLayout) -> KVCache:
    """vLLM's cache when it is one block-major tensor (``register_cross_layers_kv_cache``: ``(blocks, layers,
    block_size, heads, head)``), which must be of the ``layout`` the ``KVCacheConfig`` describes."""
    cache = KVCache.wrap(kv_cache)
    if cache.layout != layout:
        raise ValueError(f"vLLM's KV cache has layout {cache.layout}, the KV-cache config says {layout}")
    return cache
