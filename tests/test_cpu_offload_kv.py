"""KV caches as real tensors: vLLM's shape, block-major storage, batched copies that move the right bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.drivers.cpu_offload import CpuOffload
from kvfsm.drivers.kv_cache import BlockCopier, Copy, KVCache, KVLayout, copy_blocks

LAYOUT = KVLayout(num_layers=4, block_size=16, num_kv_heads=2, head_size=8)


def random_cache(num_blocks: int, seed: int) -> KVCache:
    cache = KVCache(LAYOUT, num_blocks)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def test_layers_view_is_shaped_like_vllm_and_shares_the_storage() -> None:
    cache = KVCache(LAYOUT, 10)
    assert cache.layers.shape == (4, 10, 16, 2, 8)
    cache.layers[2, 7, 3, 1, 5] = 42.0
    assert cache.block(7)[2, 3, 1, 5] == 42.0
    assert LAYOUT.block_bytes == 4 * 16 * 2 * 8 * 2


def test_wrap_adopts_an_existing_block_major_tensor_without_copying() -> None:
    storage = torch.zeros(6, 4, 16, 2, 8, dtype=torch.bfloat16)
    cache = KVCache.wrap(storage)
    assert cache.layout == KVLayout(4, 16, 2, 8, torch.bfloat16) and cache.num_blocks == 6
    copy_blocks(random_cache_like(cache), [1], cache, [5])
    assert storage[5].abs().sum() > 0
    with pytest.raises(ValueError, match="contiguous"):
        KVCache.wrap(storage.permute(1, 0, 2, 3, 4))


def random_cache_like(cache: KVCache) -> KVCache:
    other = KVCache(cache.layout, cache.num_blocks)
    other.storage.normal_()
    return other


def test_copy_blocks_moves_each_block_to_its_destination_and_nothing_else() -> None:
    src, dst = random_cache(12, 1), KVCache(LAYOUT, 9)
    before = dst.storage.clone()
    moved = copy_blocks(src, [5, 0, 11, 3], dst, [8, 2, 1, 4])
    assert moved == 4 * LAYOUT.block_bytes
    for s, d in [(5, 8), (0, 2), (11, 1), (3, 4)]:
        assert torch.equal(dst.block(d), src.block(s))
    untouched = [0, 3, 5, 6, 7]
    assert torch.equal(dst.storage[untouched], before[untouched])


def test_copy_of_one_block_and_of_none() -> None:
    src, dst = random_cache(3, 2), KVCache(LAYOUT, 3)
    assert copy_blocks(src, [], dst, []) == 0
    copy_blocks(src, [2], dst, [0])
    assert torch.equal(dst.block(0), src.block(2))


def test_copy_between_different_layouts_or_lengths_is_refused() -> None:
    other = KVCache(KVLayout(4, 16, 2, 4), 2)
    with pytest.raises(ValueError, match="cannot copy between KV layouts"):
        copy_blocks(KVCache(LAYOUT, 2), [0], other, [0])
    with pytest.raises(ValueError, match="2 source blocks but 1 destination blocks"):
        copy_blocks(KVCache(LAYOUT, 2), [0, 1], KVCache(LAYOUT, 2), [0])


def test_bytes_loaded_equal_the_bytes_stored_for_that_prefix() -> None:
    """Store a request's blocks to the CPU, load them into other GPU blocks: the bytes are identical."""
    offload = CpuOffload(LAYOUT, num_gpu_blocks=8, num_cpu_blocks=8, device="cpu")
    gpu = offload.gpu_cache
    gpu.storage.copy_(torch.randn(gpu.storage.shape, generator=torch.Generator().manual_seed(3)))
    stored = {h: gpu.block(b).clone() for b, h in [(1, 101), (6, 102), (3, 103)]}
    offload.gpu_pool.allocate("scheduler", 8)  # the requests' own blocks: the drivers hold them too
    offload.store.hold_gpu_src("a", gpu_blocks=[1, 6, 3], hashes=[101, 102, 103])
    offload.store.alloc_cpu_dst("a", gpu_blocks=[1, 6, 3], hashes=[101, 102, 103])
    src, dst = offload.store.transfer("a")
    copy_blocks(gpu, src, offload.cpu_cache, dst)
    offload.store.publish("a")
    offload.store.free_gpu_src("a")
    offload.store.free_cpu_dst("a")
    gpu.storage.zero_()  # the GPU blocks are reused by others

    offload.load.pin_cpu_hit("b", hashes=[101, 102, 103, 104])
    offload.load.hold_gpu_dst("b", gpu_blocks=[7, 0, 5])
    cpu_blocks, gpu_blocks = offload.load.transfer("b")
    copy_blocks(offload.cpu_cache, cpu_blocks, gpu, gpu_blocks)
    for b, h in zip(gpu_blocks, [101, 102, 103], strict=True):
        assert torch.equal(gpu.block(b), stored[h])


def test_copier_reports_every_job_once_and_a_failed_copy_as_failed() -> None:
    src, dst = random_cache(4, 4), KVCache(LAYOUT, 4)
    copier = BlockCopier()
    copier.submit(Copy(1, src, [0, 1], dst, [2, 3]))
    copier.submit(Copy(2, src, [0], dst, [9]))  # no block 9: the copy raises
    done = copier.poll()
    assert [job for job, _ in done] == [1, 2]
    assert done[0][1] is None and isinstance(done[1][1], IndexError)
    assert copier.poll() == []
    assert torch.equal(dst.block(3), src.block(1))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the GPU cache on the device, the CPU cache pinned"
)
def test_on_cuda_the_cpu_cache_is_pinned_and_copies_complete_asynchronously() -> None:
    offload = CpuOffload(LAYOUT, num_gpu_blocks=4, num_cpu_blocks=4)
    assert offload.gpu_cache.device.type == "cuda" and offload.cpu_cache.storage.is_pinned()
    offload.gpu_cache.storage.normal_()
    copier = BlockCopier()
    copier.submit(Copy(7, offload.gpu_cache, [0, 3], offload.cpu_cache, [1, 2]))
    done: list[tuple[int, BaseException | None]] = []
    while not done:
        done = copier.poll()
    assert done == [(7, None)]
    assert torch.equal(offload.cpu_cache.block(2), offload.gpu_cache.block(3).cpu())


# -- vLLM's own per-layer caches (register_kv_caches) -------------------------------------------

N, LAYERS, BS, HEADS, HEAD = 7, 3, 16, 2, 8
PER_LAYER = KVLayout(num_layers=2 * LAYERS, block_size=BS, num_kv_heads=HEADS, head_size=HEAD)
PAGE = 2 * BS * HEADS * HEAD * 2  # K and V of one layer's block, float16


@dataclass
class Place:
    """vLLM's KVCacheTensor: layer l's page of block b starts at offset + l*layer_stride + b*block_stride."""

    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


def vllm_allocation(
    kind: str, seed: int
) -> tuple[dict[str, torch.Tensor], list[Place], Callable[..., list[torch.Tensor]]]:
    """vLLM's per-layer tensors as its backends lay them out in one allocation, the placement vLLM describes
    them with, and how the layout itself reads block ``b`` of every layer (to check kvfsm against)."""
    names = [f"layer.{i}" for i in range(LAYERS)]
    raw = torch.randn(LAYERS * N * PAGE // 2, generator=torch.Generator().manual_seed(seed)).half()
    if kind == "cpu":  # vLLM's CPU backend: [blocks, heads, block_size, 2*head] per layer, layer-outermost
        views = [raw[i * N * PAGE // 2 :][: N * PAGE // 2].view(N, HEADS, BS, 2 * HEAD) for i in range(LAYERS)]
        place = Place(names, layer_stride=N * PAGE, block_stride=PAGE)
        return dict(zip(names, views, strict=True)), [place], lambda b: [v[b] for v in views]
    if kind == "flash":  # FlashAttention: [2, blocks, block_size, heads, head]: K and V of a block apart
        views = [raw[i * N * PAGE // 2 :][: N * PAGE // 2].view(2, N, BS, HEADS, HEAD) for i in range(LAYERS)]
        place = Place(names, layer_stride=N * PAGE, block_stride=PAGE // 2)
        return dict(zip(names, views, strict=True)), [place], lambda b: [v[:, b] for v in views]
    # block-outermost (cross-layer): each block the pages of every layer, layer i's a view of it
    packed = raw.view(N, LAYERS, 2, BS, HEADS, HEAD)
    views = [packed[:, i] for i in range(LAYERS)]
    place = Place(names, layer_stride=PAGE, block_stride=LAYERS * PAGE)
    return dict(zip(names, views, strict=True)), [place], lambda b: [v[b] for v in views]


@pytest.mark.parametrize("kind", ["cpu", "flash", "packed"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_blocks_round_trip_through_a_cpu_tier_into_vllms_own_tensors(kind: str, data: st.DataObject) -> None:
    """Any store of some blocks and load of them into other blocks leaves exactly those blocks of vLLM's
    tensors holding the stored bytes, read the layout's own way, and every other block as it was."""
    tensors, placements, block_of = vllm_allocation(kind, data.draw(st.integers(0, 1000)))
    gpu = KVCache.of_layers(tensors, N, PER_LAYER, placements)
    cpu = KVCache.like(gpu, 5)
    src = data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=5, unique=True))
    slots = data.draw(st.permutations(range(5)))[: len(src)]
    dst = data.draw(st.lists(st.integers(0, N - 1), min_size=len(src), max_size=len(src), unique=True))
    stored = {s: [b.clone() for b in block_of(s)] for s in src}
    stored_bytes = {s: gpu.block_bytes(s) for s in src}
    assert copy_blocks(gpu, src, cpu, slots) == len(src) * PER_LAYER.block_bytes
    before = {b: [t.clone() for t in block_of(b)] for b in range(N)}
    copy_blocks(cpu, slots, gpu, dst)
    for s, d in zip(src, dst, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(block_of(d), stored[s], strict=True))
        assert gpu.block_bytes(d) == stored_bytes[s]
    for b in set(range(N)) - set(dst):
        assert all(torch.equal(a, c) for a, c in zip(block_of(b), before[b], strict=True))


def test_of_layers_adopts_vllms_tensors_without_copying() -> None:
    tensors, placements, _ = vllm_allocation("cpu", 0)
    cache = KVCache.of_layers(tensors, N, PER_LAYER, placements)
    storage = next(iter(tensors.values())).untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in cache.parts)
    assert cache.num_blocks == N and cache.device.type == "cpu" and len(cache.parts) == LAYERS
    with pytest.raises(AttributeError, match="per-layer tensors"):
        _ = cache.storage
    by_shape = KVCache.of_layers(list(tensors.values()), N, PER_LAYER)  # no placements: the size-N dimension
    assert [by_shape.block_bytes(b) for b in range(N)] == [cache.block_bytes(b) for b in range(N)]


def test_of_layers_refuses_what_it_cannot_read_as_blocks() -> None:
    with pytest.raises(ValueError, match="registered no KV cache"):
        KVCache.of_layers([], N, PER_LAYER)
    with pytest.raises(ValueError, match="several dimensions fit"):
        KVCache.of_layers([torch.zeros(N, N, 16, 16)] * 3, N, PER_LAYER)
    with pytest.raises(ValueError, match="no dimension fit"):
        KVCache.of_layers([torch.zeros(3, 2, 16, 16)] * 3, N, PER_LAYER)
    with pytest.raises(ValueError, match=f"holds {PAGE} B per block in 1 tensors, but the KV-cache config describes"):
        KVCache.of_layers([torch.zeros(N, HEADS, BS, 2 * HEAD, dtype=torch.float16)], N, PER_LAYER)
    tensors, placements, _ = vllm_allocation("cpu", 0)
    with pytest.raises(ValueError, match="names a registered layer"):
        KVCache.of_layers({"other": tensors["layer.0"]}, N, PER_LAYER, placements)
    with pytest.raises(ValueError, match="cannot copy between KV layouts"):
        flash, flash_places, _ = vllm_allocation("flash", 0)
        copy_blocks(
            KVCache.of_layers(tensors, N, PER_LAYER, placements),
            [0],
            KVCache.like(KVCache.of_layers(flash, N, PER_LAYER, flash_places), 2),
            [0],
        )
