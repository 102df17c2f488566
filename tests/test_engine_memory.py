"""Clear and resume of a block store on an engine's cache: after a clear zkv
holds no engine memory (StorageWeakRef), keep_cpu really keeps the tier's
bytes, resume needs a newer generation and keeps the tier only when it still fits."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from zkv.engines import vllm
from zkv.rank.errors import CacheError
from zkv.rank.memory import geometry
from zkv.rank.memory.regions import EngineCache
from zkv.rank.store import BlockStore, Freed, TaskInvalid
from zkv.wire.protocol import TaskBody


def engine(blocks: int, block_size: int = 4, generation: int = 1):
    kv = {f"layer.{i}": torch.zeros((2, blocks, block_size, 2, 8), dtype=torch.bfloat16) for i in range(2)}
    for t in kv.values():
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16))
    return kv, EngineCache.from_tensors(vllm.flash_attn(kv), generation=generation)


def resume(store: BlockStore, cache: EngineCache, cpu_rows: int) -> bool:
    """What a resume does on an attached rank: the engine hands over, the rank
    allocates for a layout of the new cache (a resume that names its geometry)."""
    store.memory.hand_over(cache)
    store.allocate(geometry.derive(cache.descriptor, cpu_rows))
    return store.cpu_kept


def test_after_a_clear_zkv_holds_no_engine_memory_and_refuses_copies():
    kv, cache = engine(8)
    store = BlockStore.attached(cache, cpu_rows=4)
    store.move("swap_out", [1, 2], [0, 1])
    refs = [StorageWeakRef(t.untyped_storage()) for t in kv.values()]
    tier_ref = StorageWeakRef(store.tier.store.untyped_storage())
    block_bytes = cache.descriptor.block_bytes
    engine_bytes = sum(b.nbytes for b in cache.descriptor.buffers)
    del kv, cache
    assert not any(r.expired() for r in refs)
    freed = store.free(keep_cpu=False)
    assert all(r.expired() for r in refs), "the engine's free is a real free once the clear acked"
    assert tier_ref.expired() and freed == Freed(engine_bytes + 4 * block_bytes, False)
    assert store.free() == Freed(0, False)
    with pytest.raises(TaskInvalid, match="cleared"):
        store.validate(TaskBody("swap_in", [0], [0]))
    assert store.copier is None and store.cache is None


def test_keep_cpu_keeps_the_bytes_for_a_new_generation_with_another_block_count():
    kv, cache = engine(8)
    store = BlockStore.attached(cache, cpu_rows=4)
    store.move("swap_out", [5, 6], [2, 3])
    want = [t[:, 5:7].clone() for t in kv.values()]
    assert store.free(keep_cpu=True).cpu_kept
    del kv, cache  # the engine frees, updates, reallocates with more blocks
    kv2, cache2 = engine(32, generation=2)
    assert resume(store, cache2, cpu_rows=4) is True
    store.move("swap_in", [2, 3], [30, 31])
    for t, w in zip(kv2.values(), want):
        assert torch.equal(t[:, 30:32].view(torch.int16), w.view(torch.int16))


def test_a_tier_that_no_longer_fits_is_replaced_and_the_caller_is_told():
    _, cache = engine(8)
    store = BlockStore.attached(cache, cpu_rows=4)
    store.free(keep_cpu=True)
    _, other_pages = engine(8, block_size=8, generation=2)
    assert resume(store, other_pages, cpu_rows=4) is False
    store.free(keep_cpu=True)
    _, more_rows = engine(8, block_size=8, generation=3)
    assert resume(store, more_rows, cpu_rows=6) is False and store.tier.rows == 6


def test_resume_needs_a_newer_generation_and_holds_nothing_when_refused():
    kv, cache = engine(8, generation=5)
    store = BlockStore.attached(cache, cpu_rows=4)
    refs = [StorageWeakRef(t.untyped_storage()) for t in kv.values()]
    del kv, cache
    store.free(keep_cpu=True)
    for gen in (5, 4):
        new_kv, new = engine(8, generation=gen)
        new_refs = [StorageWeakRef(t.untyped_storage()) for t in new_kv.values()]
        del new_kv
        with pytest.raises(CacheError) as err:
            resume(store, new, cpu_rows=4)
        assert err.value.code == "stale_manifest"
        del new
        assert all(r.expired() for r in new_refs) and not store.allocated, "a refused cache is not held"
    assert resume(store, engine(8, generation=6)[1], cpu_rows=4) is True and store.allocated
    assert all(r.expired() for r in refs) and store.generation == 6


def test_a_resume_without_a_clear_detaches_the_old_cache_first():
    kv, cache = engine(8, generation=1)
    store = BlockStore.attached(cache, cpu_rows=4)
    refs = [StorageWeakRef(t.untyped_storage()) for t in kv.values()]
    del kv, cache
    assert resume(store, engine(16, generation=2)[1], cpu_rows=4) is True
    assert all(r.expired() for r in refs) and store.layout.gpu_blocks == 16


def test_a_resume_with_nothing_handed_over_or_the_wrong_block_count_fails_naming_why():
    _, cache = engine(8)
    store = BlockStore.attached(cache, cpu_rows=4)
    store.free(keep_cpu=True)
    with pytest.raises(CacheError) as err:
        store.allocate(store.layout)
    assert err.value.code == "no_cache"
    store.memory.hand_over(engine(16, generation=2)[1])
    with pytest.raises(CacheError, match="16 blocks.*gpu_blocks=8") as err:
        store.allocate(store.layout)
    assert err.value.code == "bad_layout" and not store.allocated and store.tier is not None


def test_a_restarted_engine_is_told_apart_from_a_stale_manifest(tmp_path):
    """docs/engines.md, "Generations and restarts": a resume takes the first
    cache of another engine instance at any generation, refuses the replaced
    instance's manifest, and within one instance needs a newer generation
    than one the bus used (the cache a rank attached at its start and never
    served may be taken once more)."""
    from zkv.harness.bus.ipc_check import mapped
    from zkv.rank.memory import layouts
    from zkv.rank.memory.manifest import ShmArena, export_manifest

    path, arena = str(tmp_path / "m"), ShmArena()
    try:
        k = arena.tensor("k", (8, 2, 4, 8), torch.bfloat16)
        entries = layouts.per_layer({"k": k})
        export_manifest(path, entries, generation=3, arena=arena, instance="engine-a")
        store = BlockStore.from_manifest(path, {"cpu_blocks": 4})
        assert (store.instance, store.generation) == ("engine-a", 3)

        def resume() -> None:
            store.free(keep_cpu=True)
            store.allocate(store.layout)

        store.free(keep_cpu=True)
        store.allocate(store.layout)  # the very export attached at start, never used by the bus: taken again
        assert store.allocated and store.handover.used
        for export, refusal in (
            (("engine-a", 3), "generation 3 is not newer than 3"),  # the engine died before it exported again
            (("engine-b", 1), None),  # its restart: a first generation again, under a new instance
            (("engine-a", 4), "engine instance engine-a was replaced by engine-b"),  # never taken again
            (("engine-b", 1), "generation 1 is not newer than 1"),
            (("engine-b", 2), None),
        ):
            export_manifest(path, entries, generation=export[1], arena=arena, instance=export[0])
            if refusal is None:
                resume()
                assert (store.instance, store.generation) == export and store.allocated
                continue
            with pytest.raises(CacheError, match=refusal) as err:
                resume()
            assert err.value.code == "stale_manifest"
            assert not store.allocated and mapped(arena.tag) == 1, "a refused manifest stays unmapped"
        store.close()
    finally:
        arena.close()
