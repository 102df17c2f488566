"""The CUDA control flow of zkv's own block store (``BlockStore.owned``), on a machine without a GPU.

CUDA cannot run here, so torch.cuda's streams, events and cache calls are
recording fakes that model stream order (tests/fake_cuda.py, the only mocks
in the suite) while the copies run on real CPU tensors.  The owned cache
shares the engine-attached copy engine (regions over its store, a
block-major pinned tier); on a GPU machine ``python -m zkv.harness.copies.gpu_check``
runs the same code for real.
"""

import random

import pytest
from fake_cuda import fake_cuda_fixture  # noqa: F401  (the fake_cuda fixture)

from zkv.rank.copies.copier import CopyEngine
from zkv.rank.store import BlockStore
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=96, block_size=2, kv_heads=1, head_dim=4)
CHUNK_ROWS = 8


def cuda_like_cache(rec) -> BlockStore:
    cache = BlockStore.owned(LAYOUT, "cpu")
    cache.memory.cuda = True
    assert cache.cache is not None and cache.tier is not None and cache.memory.store is not None
    cache.copier = CopyEngine(cache.cache, cache.tier, staging_bytes=2 * CHUNK_ROWS * cache.tier.row_bytes, cuda=True)
    rec.watch("engine", cache.memory.store)
    rec.watch("tier", cache.tier.store)
    rec.clear()
    return cache


def assert_ordered_and_synced(rec):
    assert not rec.unordered(), (
        f"ops on cache memory before the streams waited for the compute stream: {rec.unordered()}"
    )
    assert not rec.unsynced(), "the swap returned before an event covering all its copies completed"
    assert not rec.races(), f"copies on the same bytes in no stream order: {rec.races()[:3]}"
    assert rec.calls[-1][0] == "event.synchronize" and rec.calls[-1][2] is True


@pytest.mark.parametrize(
    "src,dst", [([0, 1, 2], [5, 6, 7]), ([3, 9, 1], [0, 30, 12]), (list(range(20)), list(range(40, 60)))]
)
def test_swaps_wait_for_the_compute_stream_and_return_after_an_event(fake_cuda, src, dst):
    cache = cuda_like_cache(fake_cuda)
    cache.fill("gpu", src, seed=5)
    before = cache.checksum("gpu", src)
    fake_cuda.clear()
    cache.move("swap_out", src, dst)
    assert fake_cuda.calls[0] == ("wait_stream", cache.copier.staged.copy_stream.name, "compute")
    assert_ordered_and_synced(fake_cuda)
    assert cache.checksum("cpu", dst) == before
    cache.fill("gpu", src, seed=6)
    fake_cuda.clear()
    cache.move("swap_in", dst, src)
    assert_ordered_and_synced(fake_cuda)
    assert cache.checksum("gpu", src) == before


@pytest.mark.parametrize("op", ["swap_out", "swap_in"])
def test_a_scattered_swap_is_one_gather_and_one_transfer_per_staging_chunk(fake_cuda, op):
    cache = cuda_like_cache(fake_cuda)
    rng = random.Random(4)
    blocks, rows = rng.sample(range(64), 30), [r + 50 for r in rng.sample(range(30), 30)]
    cache.fill("gpu" if op == "swap_out" else "cpu", blocks if op == "swap_out" else rows, seed=1)
    fake_cuda.clear()
    cache.move(op, blocks, rows) if op == "swap_out" else cache.move(op, rows, blocks)
    transfers = fake_cuda.on("tier")
    assert len(transfers) == 4, "30 pairs, 8 rows a chunk: four transfers across the link"
    assert all(
        t.kind == "copy_" and t.contiguous and t.non_blocking and "engine" not in (t.src, t.dst) for t in transfers
    )
    kernels = [o.kind for o in fake_cuda.on("engine")]
    assert kernels == ["index_select" if op == "swap_out" else "index_copy_"] * 4, (
        "every layer's K and V in one kernel per chunk"
    )
    assert_ordered_and_synced(fake_cuda)
    assert cache.checksum("cpu", rows) == cache.checksum("gpu", blocks)


def test_no_pinned_allocation_after_the_first_swap(fake_cuda):
    cache = cuda_like_cache(fake_cuda)
    rng = random.Random(5)
    cache.move("swap_out", rng.sample(range(64), 16), rng.sample(range(96), 16))
    cache.fill("cpu", list(range(96)), seed=5)  # every row written: a swap-in reads any of them
    first, staging = fake_cuda.pinned_allocations, cache.copier.staged._staging
    assert first == 1, "the index upload buffer, once"
    for _ in range(40):
        n = rng.randint(1, 64)
        cache.move("swap_out", rng.sample(range(64), n), rng.sample(range(96), n))
        cache.move("swap_in", rng.sample(range(96), n), rng.sample(range(64), n))
    assert fake_cuda.pinned_allocations == first, "swaps allocate no pinned memory"
    assert cache.copier.staged._staging is staging, "the staging buffers are allocated once per cache allocation"


def test_free_returns_memory_to_the_driver(fake_cuda):
    cache = cuda_like_cache(fake_cuda)
    freed = cache.free(keep_cpu=False)
    assert freed.nbytes > 0 and ("empty_cache",) in fake_cuda.calls
    assert fake_cuda.calls.index(("synchronize",)) < fake_cuda.calls.index(("empty_cache",)), "no free while copies run"
    assert cache.copier is None and cache.cache is None and cache.memory.store is None


def test_the_swap_space_is_pinned_on_cuda(fake_cuda):
    cache = BlockStore.owned(LAYOUT, "cpu")
    cache.memory.cuda = True  # what a cuda device sets; the fakes turn pinned allocations into counted plain ones
    cache.allocate(LAYOUT.with_changes(cpu_blocks=128))
    assert cache.tier is not None and cache.tier.pinned and fake_cuda.pinned_allocations == 1
