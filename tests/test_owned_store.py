"""zkv's own block store (``BlockStore.owned``) on real torch tensors:
coalescing, validation, round trips, clear and reallocation."""

import pytest
import torch

from zkv.rank.copies.copier import coalesce
from zkv.rank.errors import CacheError
from zkv.rank.store import BlockStore, TaskInvalid
from zkv.wire.layout import CacheLayout
from zkv.wire.protocol import TaskBody

LAYOUT = CacheLayout(layers=2, gpu_blocks=32, cpu_blocks=64, block_size=4, kv_heads=2, head_dim=8)


def test_coalesce_merges_runs_of_consecutive_pairs_in_any_order():
    assert coalesce([3, 1, 2, 9], [13, 11, 12, 20]) == [(1, 11, 3), (9, 20, 1)]
    assert coalesce([0, 1, 2], [5, 7, 6]) == [(0, 5, 1), (1, 7, 1), (2, 6, 1)]
    assert coalesce([], []) == []


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_swap_out_and_in_round_trip_bit_identical_for_mixed_ids(dtype):
    cache = BlockStore.owned(LAYOUT.with_changes(dtype=dtype))
    gpu = [0, 1, 2, 3, 10, 20, 7, 31]  # a run of four and scattered ids
    cpu = [40, 41, 42, 43, 5, 60, 1, 63]
    cache.fill("gpu", gpu, seed=3)
    before = cache.checksum("gpu", gpu)
    assert len(set(before)) == len(gpu), "fill gives distinct blocks"
    assert cache.move("swap_out", gpu, cpu) == len(gpu) * LAYOUT.with_changes(dtype=dtype).block_bytes
    assert cache.checksum("cpu", cpu) == before
    cache.fill("gpu", gpu, seed=4)
    assert cache.checksum("gpu", gpu) != before
    cache.move("swap_in", cpu, gpu)
    assert cache.checksum("gpu", gpu) == before
    untouched = [b for b in range(LAYOUT.gpu_blocks) if b not in gpu]
    assert all(bool((t[untouched] == 0).all()) for t in cache.views("gpu"))


def test_swap_writes_only_the_destination_blocks_of_every_layer():
    cache = BlockStore.owned(LAYOUT)
    cache.fill("gpu", [5], seed=1)
    cache.move("swap_out", [5], [9])
    assert len(cache.views("gpu")) == 2 * LAYOUT.layers, "a K and a V region per layer"
    for g, c in zip(cache.views("gpu"), cache.views("cpu")):
        assert torch.equal(g[5], c[9])  # bytes: fill may make NaNs
        assert bool((c[8] == 0).all()) and bool((c[10] == 0).all())


@pytest.mark.parametrize(
    "body,reason",
    [
        (TaskBody("swap_out", [32], [0]), "src block id 32 is out of range for the gpu tier"),
        (TaskBody("swap_out", [0], [64]), "dst block id 64 is out of range for the cpu tier"),
        (TaskBody("swap_in", [0, 1], [3, 3]), "duplicate"),
        (TaskBody("swap_in", [-1], [3]), "out of range"),
        (TaskBody("fill", [], [1, 1], "cpu"), "duplicate"),
        (TaskBody("checksum", [99], [], "gpu"), "out of range"),
    ],
)
def test_validate_names_the_problem(body, reason):
    cache = BlockStore.owned(LAYOUT)
    with pytest.raises(CacheError, match=reason) as err:
        cache.validate(body)
    assert err.value.code == "bad_block_id"


def test_free_and_allocate_report_bytes_and_refuse_tasks_while_freed():
    cache = BlockStore.owned(LAYOUT)
    total = cache.nbytes()
    cpu_bytes = LAYOUT.cpu_blocks * LAYOUT.block_bytes
    assert cache.tier_nbytes() == {"gpu": LAYOUT.gpu_blocks * LAYOUT.block_bytes, "cpu": cpu_bytes}
    freed = cache.free(keep_cpu=True)
    assert freed.nbytes == total - cpu_bytes and freed.cpu_kept
    assert cache.tier_nbytes() == {"gpu": 0, "cpu": cpu_bytes}
    assert cache.tier is not None and not cache.allocated
    with pytest.raises(TaskInvalid, match="cleared"):
        cache.validate(TaskBody("swap_out", [0], [0]))
    bigger = LAYOUT.with_changes(gpu_blocks=48)
    assert cache.allocate(bigger) == cache.nbytes() and cache.views("gpu")[0].shape[0] == 48
    assert cache.cpu_kept, "the same CPU shape: the tier stayed, bit for bit"
    cache.free(keep_cpu=True)
    cache.allocate(bigger.with_changes(head_dim=4, kv_heads=4))
    assert not cache.cpu_kept, "another model shape: a new tier, even with the same page bytes"
