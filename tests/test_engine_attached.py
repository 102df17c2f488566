"""Clear and resume of an engine-attached cache: after a clear zkv holds no
engine memory (StorageWeakRef), keep_cpu really keeps the tier's bytes,
resume needs a newer generation and keeps the tier only when it still fits."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from zkv.engines import vllm
from zkv.rank.cache.attached import AttachedCache
from zkv.rank.cache.errors import CacheError
from zkv.rank.cache.regions import EngineCache


def engine(blocks: int, block_size: int = 4, generation: int = 1):
    kv = {f"layer.{i}": torch.zeros((2, blocks, block_size, 2, 8), dtype=torch.bfloat16) for i in range(2)}
    for t in kv.values():
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16))
    return kv, EngineCache.from_tensors(vllm.flash_attn(kv), generation=generation)


def test_after_a_clear_zkv_holds_no_engine_memory_and_refuses_copies():
    kv, cache = engine(8)
    rank = AttachedCache(cache, cpu_rows=4)
    rank.swap_out([1, 2], [0, 1])
    refs = [StorageWeakRef(t.untyped_storage()) for t in kv.values()]
    tier_ref = StorageWeakRef(rank.tier.store.untyped_storage())
    block_bytes = cache.descriptor.block_bytes
    del kv, cache
    assert not any(r.expired() for r in refs)
    ack = rank.clear(keep_cpu=False)
    assert all(r.expired() for r in refs), "the engine's free is a real free once the clear acked"
    assert tier_ref.expired() and ack["cpu_bytes_freed"] == 4 * block_bytes and not ack["cpu_kept"]
    assert rank.clear() == {"engine_bytes_detached": 0, "cpu_bytes_freed": 0, "cpu_kept": False}
    with pytest.raises(CacheError) as err:
        rank.swap_in([0], [0])
    assert err.value.code == "released"


def test_keep_cpu_keeps_the_bytes_for_a_new_generation_with_another_block_count():
    kv, cache = engine(8)
    rank = AttachedCache(cache, cpu_rows=4)
    rank.swap_out([5, 6], [2, 3])
    want = [t[:, 5:7].clone() for t in kv.values()]
    assert rank.clear(keep_cpu=True)["cpu_kept"]
    del kv, cache  # the engine frees, updates, reallocates with more blocks
    kv2, cache2 = engine(32, generation=2)
    assert rank.resume(cache2, cpu_rows=4) is True
    rank.swap_in([2, 3], [30, 31])
    for t, w in zip(kv2.values(), want):
        assert torch.equal(t[:, 30:32].view(torch.int16), w.view(torch.int16))


def test_a_tier_that_no_longer_fits_is_replaced_and_the_caller_is_told():
    _, cache = engine(8)
    rank = AttachedCache(cache, cpu_rows=4)
    rank.clear(keep_cpu=True)
    _, other_pages = engine(8, block_size=8, generation=2)
    assert rank.resume(other_pages, cpu_rows=4) is False
    rank.clear(keep_cpu=True)
    _, more_rows = engine(8, block_size=8, generation=3)
    assert rank.resume(more_rows, cpu_rows=6) is False and rank.tier.rows == 6


def test_resume_needs_a_cleared_rank_and_a_newer_generation():
    _, cache = engine(8, generation=5)
    rank = AttachedCache(cache, cpu_rows=4)
    with pytest.raises(CacheError, match="clear first"):
        rank.resume(engine(8, generation=6)[1], cpu_rows=4)
    rank.clear()
    for gen in (5, 4):
        with pytest.raises(CacheError) as err:
            rank.resume(engine(8, generation=gen)[1], cpu_rows=4)
        assert err.value.code == "stale_manifest"
    assert rank.resume(engine(8, generation=6)[1], cpu_rows=4) is False and rank.attached
