"""Block allocator: ids 0..N-1, accounting, and loud misuse; the engine's
reserved ids never handed out, down to a prefix cache manager on a real
vLLM-shaped cache served by a real rank (docs/engines.md, "Reserved rows")."""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.client.client import Client
from zkv.engines import vllm
from zkv.net.endpoints import Endpoints
from zkv.prefix import PrefixCacheManager
from zkv.rank.agent import RankAgent
from zkv.rows.pool import DoubleFreeError, ForeignBlockError, OutOfBlocksError, RowPool


def test_fresh_allocator_hands_out_ascending_ids_and_accounts():
    allocator = RowPool(5)
    assert (allocator.num_free, allocator.num_used, allocator.num_blocks) == (5, 0, 5)
    assert allocator.alloc(3) == [0, 1, 2]
    assert (allocator.num_free, allocator.num_used) == (2, 3)
    assert allocator.allocated_ids() == [0, 1, 2]
    allocator.check()


def test_freed_blocks_are_reused_first():
    allocator = RowPool(4)
    allocator.alloc(3)
    allocator.free([1])
    assert allocator.alloc(1) == [1]


def test_double_free_raises_and_changes_nothing():
    allocator = RowPool(4)
    allocator.alloc(2)
    allocator.free([0])
    with pytest.raises(DoubleFreeError, match="block 0 freed twice"):
        allocator.free([1, 0])
    assert allocator.is_allocated(1) and allocator.num_free == 3
    with pytest.raises(DoubleFreeError):
        allocator.free([1, 1])
    assert allocator.is_allocated(1)
    allocator.check()


@pytest.mark.parametrize("foreign", [-1, 4, 99, "1", 1.0, True, None])
def test_foreign_ids_raise(foreign):
    allocator = RowPool(4, "cpu")
    allocator.alloc(4)
    with pytest.raises(ForeignBlockError, match="cpu"):
        allocator.free([foreign])
    assert allocator.num_used == 4


def test_alloc_is_all_or_nothing():
    allocator = RowPool(3)
    allocator.alloc(2)
    with pytest.raises(OutOfBlocksError, match="only 1 of 3 free"):
        allocator.alloc(2)
    assert allocator.num_free == 1
    assert allocator.alloc(0) == []
    with pytest.raises(ValueError):
        allocator.alloc(-1)


def test_empty_tier():
    allocator = RowPool(0)
    assert allocator.alloc(0) == [] and allocator.num_free == 0
    with pytest.raises(OutOfBlocksError):
        allocator.alloc(1)
    with pytest.raises(ValueError):
        RowPool(-1)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 20), st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_random_alloc_free_keeps_accounting(total, steps):
    allocator = RowPool(total)
    held: list[int] = []
    for do_alloc, count in steps:
        if do_alloc:
            if count <= allocator.num_free:
                got = allocator.alloc(count)
                assert not set(got) & set(held)
                held += got
            else:
                with pytest.raises(OutOfBlocksError):
                    allocator.alloc(count)
        else:
            freed, held = held[:count], held[count:]
            allocator.free(freed)
        assert allocator.num_free + allocator.num_used == total
        assert allocator.allocated_ids() == sorted(held)
        allocator.check()


def test_reserved_ids_are_never_handed_out_and_cannot_be_freed():
    allocator = RowPool(6, "gpu", reserved=(3, 0))
    assert (allocator.num_blocks, allocator.num_free, allocator.num_used, allocator.num_reserved) == (6, 4, 0, 2)
    assert allocator.alloc(4) == [1, 2, 4, 5]
    with pytest.raises(OutOfBlocksError, match="only 0 of 6 free"):
        allocator.alloc(1)
    with pytest.raises(ForeignBlockError, match="block 0 is reserved by the engine"):
        allocator.free([1, 0])
    assert allocator.is_allocated(1) and not allocator.is_allocated(0), "a bad free changes nothing"
    assert allocator.allocated_ids() == [1, 2, 4, 5]
    allocator.check()
    allocator.free([5, 1])
    assert allocator.alloc(2) == [1, 5] and allocator.num_used == 4
    allocator.check()
    for bad in ((6,), (-1,), (True,), ("0",)):
        with pytest.raises(ValueError, match="reserved id"):
            RowPool(6, "gpu", reserved=bad)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 20).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)))))
def test_a_tier_with_reserved_ids_hands_out_every_other_id_once(case):
    total, reserved = case
    allocator = RowPool(total, reserved=reserved)
    got = allocator.alloc(total - len(reserved))
    assert sorted(got) == sorted(set(range(total)) - reserved)
    allocator.check()
    allocator.free(got)
    assert allocator.num_free == total - len(reserved) and allocator.num_used == 0


NB, BS, H, D, L, CPU_ROWS = 8, 4, 2, 8, 2, 16


def test_a_prefix_manager_on_a_vllm_cache_never_hands_out_the_null_block(tmp_path):
    """The reserved ids come from the rank the engine runs (not over the wire):
    every block the manager hands out is filled, swapped out and back through
    the bus, and a manager that did not know would hand out block 0, which the
    rank refuses."""
    kv = {f"layers.{i}.attn": torch.zeros((2, NB, BS, H, D), dtype=torch.float16) for i in range(L)}
    endpoints = Endpoints.in_dir(tmp_path)
    broker = Broker(endpoints, BrokerConfig(world=1, heartbeat_ms=100))
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    agent = RankAgent(0, 1, endpoints.backend, endpoints.control, vllm.flash_attn(kv), CPU_ROWS)
    try:
        agent.start(timeout=30)
        assert agent.reserved_blocks == (vllm.NULL_BLOCK,) == (0,)
        with Client(endpoints.frontend) as client:
            gpu_blocks = client.status(timeout=10).layout.gpu_blocks
            assert gpu_blocks == NB, "the null block counts: ids are the engine's"
            manager = PrefixCacheManager(
                client, BS, gpu_blocks, CPU_ROWS, swap_timeout=10.0, reserved_gpu_blocks=agent.reserved_blocks
            )
            handed: list[int] = []
            prompts = [[seed * 1000 + t for t in range(3 * BS)] for seed in range(4)]  # 12 blocks > 7 usable
            first_digests = None
            for seed, tokens in enumerate(prompts):
                cached = manager.match(tokens)
                fresh = manager.allocate(3 - cached.num_blocks)
                handed += fresh.block_ids
                fill = client.run("fill", None, fresh.block_ids, tier="gpu", seed=seed, timeout=30)
                assert fill.ok, fill.reason
                if seed == 0:
                    first_digests = client.run("checksum", fresh.block_ids, tier="gpu", timeout=30).per_rank[0]
                manager.insert(tokens, cached.block_ids + fresh.block_ids)
                manager.release(cached)
                manager.release(fresh)
            back = manager.match(prompts[0])  # swapped out to make room: comes back in through the bus
            assert back.cpu_hit_blocks == 3 and 0 not in back.block_ids
            again = client.run("checksum", back.block_ids, tier="gpu", timeout=30).per_rank[0]
            assert again["digests"] == first_digests["digests"], "the blocks came back bit for bit"
            manager.release(back)
            stats = manager.stats()
            assert 0 not in handed and len(handed) == 12
            assert stats["swaps"]["swap_out"]["ok"] > 0 and stats["swaps"]["swap_in"]["ok"] == 1
            assert not stats["swaps"]["swap_out"]["failed"] and not stats["swaps"]["swap_in"]["failed"]
            assert stats["gpu"]["reserved"] == 1
            assert stats["gpu"]["free"] + stats["gpu"]["used"] + stats["gpu"]["reserved"] == stats["gpu"]["total"]
            manager.check_invariants()

            unaware = PrefixCacheManager(client, BS, gpu_blocks, CPU_ROWS, swap_timeout=10.0)
            lease = unaware.allocate(1)
            assert lease.block_ids == [0]
            refused = client.run("fill", None, lease.block_ids, tier="gpu", seed=9, timeout=30)
            assert not refused.ok and "dst block id 0 is reserved by the engine" in (refused.reason or "")
    finally:
        agent.stop(timeout=10)
        broker.stop()
        thread.join(timeout=10)
    assert not thread.is_alive()
