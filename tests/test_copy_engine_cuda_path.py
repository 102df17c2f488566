"""The CUDA control flow of the engine-cache copy engine, without a GPU.

torch.cuda's streams, events and stream contexts are recording fakes that
model stream order (tests/fake_cuda.py, the only mocks here); the copies run
on real CPU tensors, so the bytes are still checked.  On a GPU machine the
same code runs for real (``python -m zkv.harness.copies.gpu_check``)."""

from __future__ import annotations

import random

import pytest
import torch
from fake_cuda import fake_cuda_fixture  # noqa: F401  (the fake_cuda fixture)

from zkv.rank.copies.copier import CopyEngine
from zkv.rank.copies.staging import Chunk, plan
from zkv.rank.memory import layouts
from zkv.rank.memory.regions import EngineCache
from zkv.rank.tiers.cpu_tier import CpuTier


def one_region(rec, rows=8, **kw):
    k = torch.arange(8 * 64, dtype=torch.float32).view(8, 2, 4, 8)
    cache = EngineCache.from_tensors(layouts.per_layer({"k": k}))
    tier = CpuTier.for_cache(cache.descriptor, rows=rows, pin=True)
    copier = CopyEngine(cache, tier, cuda=True, **kw)
    rec.watch("engine", k)
    rec.watch("tier", tier.store)
    rec.clear()
    return k, copier


def per_layer(rec, tensors=3, blocks=48, rows=64, staging_rows=8, shared_store=False):
    """FastDeploy-style separate K/V tensors (one region each), or zkv's one store."""
    if shared_store:
        store = torch.randint(0, 1000, (tensors, blocks, 2, 4, 8), dtype=torch.int32)
        ks = list(store.unbind(0))
    else:
        ks = [torch.randint(0, 1000, (blocks, 2, 4, 8), dtype=torch.int32) for _ in range(tensors)]
    cache = EngineCache.from_tensors(layouts.per_layer({f"t{i}": k for i, k in enumerate(ks)}))
    tier = CpuTier.for_cache(cache.descriptor, rows=rows, pin=True)
    copier = CopyEngine(cache, tier, staging_bytes=2 * staging_rows * tier.row_bytes, cuda=True)
    rec.watch("engine", *ks)
    rec.watch("tier", tier.store)
    rec.clear()
    return ks, tier, copier


def assert_ordered_and_synced(rec):
    assert not rec.unordered(), (
        f"ops on engine or tier memory before the streams waited for the engine: {rec.unordered()}"
    )
    assert not rec.unsynced(), "the swap returned before an event covering all its copies completed"
    assert not rec.races(), f"copies on the same bytes in no stream order: {rec.races()[:3]}"
    assert rec.calls[-1][0] == "event.synchronize" and rec.calls[-1][2] is True, "last: a blocking event, synchronized"


def test_plan_cuts_row_sorted_pairs_into_chunks_of_row_runs():
    pairs = [(0, 7), (1, 8), (2, 9), (5, 3), (6, 1)]
    assert plan(pairs, 3) == [Chunk(0, 3, 7, ((0, 0, 3),)), Chunk(3, 2, None, ((5, 0, 2),))]
    assert plan([(0, 4), (2, 5), (3, 6)], 8) == [Chunk(0, 3, 4, ((0, 0, 1), (2, 1, 2)))]
    assert plan([(4, 0), (4, 1)], 8) == [Chunk(0, 2, 0, ((4, 0, 1), (4, 1, 1)))], "a row read twice: two runs"


def test_a_swap_waits_for_the_compute_stream_before_any_copy_and_returns_after_an_event(fake_cuda):
    k, copier = one_region(fake_cuda)
    want = k[[1, 4]].clone()
    copier.swap_out([1, 4], [0, 1])
    copy, xfer = copier.staged.copy_stream.name, copier.staged.xfer_stream.name
    assert fake_cuda.calls[:2] == [("wait_stream", copy, "compute"), ("wait_stream", xfer, copy)]
    assert fake_cuda.on("engine") and fake_cuda.on("tier")
    assert_ordered_and_synced(fake_cuda)
    k.zero_()
    fake_cuda.clear()
    copier.swap_in([0, 1], [6, 7])
    assert_ordered_and_synced(fake_cuda)
    assert torch.equal(k[6:8], want)


def test_an_event_passed_with_the_task_replaces_the_stream_wait(fake_cuda):
    _, copier = one_region(fake_cuda)
    copier.swap_out([0], [0], wait_event="engine-event")
    assert fake_cuda.calls[0] == ("wait_event", copier.staged.copy_stream.name, "engine-event")
    assert not any(c[0] == "wait_stream" and c[2] == "compute" for c in fake_cuda.calls)
    assert_ordered_and_synced(fake_cuda)


def test_the_engine_can_name_its_compute_stream(fake_cuda):
    _, copier = one_region(fake_cuda, compute_stream="engine-stream")
    copier.swap_in([0], [0])
    assert fake_cuda.calls[0] == ("wait_stream", copier.staged.copy_stream.name, "engine-stream")
    assert_ordered_and_synced(fake_cuda)


@pytest.mark.parametrize("staging_rows", [1, 3, 64])
@pytest.mark.parametrize("shared_store", [False, True])
def test_multi_region_swaps_round_trip_through_the_staging_buffers(fake_cuda, staging_rows, shared_store):
    ks, tier, copier = per_layer(fake_cuda, staging_rows=staging_rows, shared_store=shared_store)
    src, rows, dst = [0, 1, 2, 3, 4, 9, 30], [5, 6, 7, 8, 9, 0, 40], [6, 7, 8, 9, 10, 11, 47]
    want = [k[src].clone() for k in ks]
    copier.swap_out(src, rows)
    assert_ordered_and_synced(fake_cuda)
    assert copier.staged._staging is not None and copier.staged._staging.shape == (2, staging_rows, tier.row_bytes)
    for k in ks:
        k.zero_()
    fake_cuda.clear()
    copier.swap_in(rows, dst)
    assert_ordered_and_synced(fake_cuda)
    assert all(torch.equal(k[dst], w) for k, w in zip(ks, want))
    copier.close()
    assert copier.staged._staging is None


@pytest.mark.parametrize("op", ["swap_out", "swap_in"])
def test_a_scattered_swap_crosses_the_link_once_per_staging_chunk_with_no_host_scatter(fake_cuda, op):
    ks, tier, copier = per_layer(fake_cuda, blocks=96, rows=64, staging_rows=8)
    rng = random.Random(1)
    blocks, rows = rng.sample(range(96), 40), rng.sample(range(40), 40)  # scattered blocks, a shuffled run of rows
    want = [k[blocks].clone() for k in ks]
    if op == "swap_in":
        copier.swap_out(blocks, rows)
        for k in ks:
            k.zero_()
        fake_cuda.clear()
        copier.swap_in(rows, blocks)
    else:
        copier.swap_out(blocks, rows)
    transfers = fake_cuda.on("tier")
    assert len(transfers) == 5, "40 pairs, 8 rows a chunk: five transfers"
    assert all(t.kind == "copy_" and t.contiguous and t.non_blocking for t in transfers), (
        "every transfer is one contiguous asynchronous copy between pinned rows and a staging buffer"
    )
    assert all("engine" not in (t.dst, t.src) for t in transfers), "the link carries staged rows only"
    gathers = [op for op in fake_cuda.on("engine") if op.kind in ("index_select", "index_copy_")]
    assert len(gathers) == 5 * len(ks), "one gather (or scatter) per region per chunk, on the device"
    assert_ordered_and_synced(fake_cuda)
    if op == "swap_in":
        assert all(torch.equal(k[blocks], w) for k, w in zip(ks, want))
    else:
        assert all(
            torch.equal(tier.columns[i][rows].view(torch.int32).view(40, 2, 4, 8), w) for i, w in enumerate(want)
        )


def test_regions_equally_spaced_in_one_store_gather_in_one_kernel_per_chunk(fake_cuda):
    ks, _, copier = per_layer(fake_cuda, tensors=6, blocks=96, staging_rows=8, shared_store=True)
    assert len(copier.staged.specs) == 1
    blocks = random.Random(2).sample(range(96), 40)
    copier.swap_out(blocks, list(range(40)))
    assert [op.kind for op in fake_cuda.on("engine")] == ["index_select"] * 5
    assert_ordered_and_synced(fake_cuda)


def test_contiguous_ids_of_a_one_region_cache_copy_directly_without_staging(fake_cuda):
    _, copier = one_region(fake_cuda, rows=8, staging_bytes=2 * 3 * 256)
    copier.swap_out(list(range(7)), list(range(1, 8)))
    transfers = fake_cuda.on("tier")
    assert [(t.src, t.contiguous) for t in transfers] == [("engine", True)] * 3, (
        "7 blocks, 3 a chunk, engine -> pinned rows"
    )
    assert copier.staged._staging is None
    assert_ordered_and_synced(fake_cuda)


def test_no_pinned_or_staging_allocation_after_the_first_swap(fake_cuda):
    ks, tier, copier = per_layer(fake_cuda, blocks=96, rows=64, staging_rows=8)
    assert fake_cuda.pinned_allocations == 1, "the tier"
    rng = random.Random(3)
    copier.swap_out(rng.sample(range(96), 20), rng.sample(range(64), 20))
    first, staging = fake_cuda.pinned_allocations, copier.staged._staging
    for _ in range(30):
        n = rng.randint(1, 64)
        copier.swap_out(rng.sample(range(96), n), rng.sample(range(64), n))
        copier.swap_in(rng.sample(range(64), n), rng.sample(range(96), n))
    assert first == 2, "the tier and the pinned index upload buffer"
    assert fake_cuda.pinned_allocations == first, "a swap allocates no pinned memory"
    assert copier.staged._staging is staging, "the staging buffers are allocated once"


def test_the_tier_is_pinned_when_cuda_exists(monkeypatch):
    seen = []
    real_zeros = torch.zeros

    def zeros(*args, pin_memory=False, **kw):
        seen.append(pin_memory)
        return real_zeros(*args, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "zeros", zeros)
    tier = CpuTier([("k", 64)], rows=2)
    assert tier.pinned and seen == [True]


def test_the_rank_backend_waits_for_the_stream_the_engine_passed(fake_cuda):
    """RankAgent(compute_stream=s) -> BlockStore.attached -> EngineMemory -> CopyEngine: copies wait for s."""
    from zkv.rank.store import BlockStore

    k = torch.arange(8 * 64, dtype=torch.float32).view(8, 2, 4, 8)
    store = BlockStore.attached(
        EngineCache.from_tensors(layouts.per_layer({"k": k})), 8, compute_stream="engine-stream", pin=True
    )
    store.copier = CopyEngine(store.cache, store.tier, store.memory.compute_stream, cuda=True)
    fake_cuda.watch("engine", k)
    fake_cuda.clear()
    store.move("swap_out", [2, 3], [0, 1])
    assert fake_cuda.calls[0] == ("wait_stream", store.copier.staged.copy_stream.name, "engine-stream")
    assert_ordered_and_synced(fake_cuda)


@pytest.mark.parametrize("shared_store", [False, True])
def test_release_alone_drops_every_view_the_cuda_path_built(fake_cuda, shared_store):
    from torch.multiprocessing.reductions import StorageWeakRef

    ks, _, copier = per_layer(fake_cuda, shared_store=shared_store)
    refs = [StorageWeakRef(k.untyped_storage()) for k in ks]
    copier.swap_out([0, 5, 9], [0, 1, 2])  # indexed: grouped views built
    copier.swap_in(list(range(3)), list(range(10, 13)))  # one run: slice views
    del ks  # the engine frees ...
    assert not any(r.expired() for r in refs)
    copier.cache.release()
    assert all(r.expired() for r in refs), "after release the engine's free is a real free, staging or not"
