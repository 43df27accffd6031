"""KV caches as real tensors: vLLM's shape, block-major storage, batched copies that move the right bytes."""

from __future__ import annotations

import pytest
import torch

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
