"""Block allocator: ids 0..N-1, accounting, and loud misuse."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkv.prefix.allocator import BlockAllocator, DoubleFreeError, ForeignBlockError, OutOfBlocksError


def test_fresh_allocator_hands_out_ascending_ids_and_accounts():
    allocator = BlockAllocator(5)
    assert (allocator.num_free, allocator.num_used, allocator.num_blocks) == (5, 0, 5)
    assert allocator.alloc(3) == [0, 1, 2]
    assert (allocator.num_free, allocator.num_used) == (2, 3)
    assert allocator.allocated_ids() == [0, 1, 2]
    allocator.check()


def test_freed_blocks_are_reused_first():
    allocator = BlockAllocator(4)
    allocator.alloc(3)
    allocator.free([1])
    assert allocator.alloc(1) == [1]


def test_double_free_raises_and_changes_nothing():
    allocator = BlockAllocator(4)
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
    allocator = BlockAllocator(4, "cpu")
    allocator.alloc(4)
    with pytest.raises(ForeignBlockError, match="cpu"):
        allocator.free([foreign])
    assert allocator.num_used == 4


def test_alloc_is_all_or_nothing():
    allocator = BlockAllocator(3)
    allocator.alloc(2)
    with pytest.raises(OutOfBlocksError, match="only 1 of 3 free"):
        allocator.alloc(2)
    assert allocator.num_free == 1
    assert allocator.alloc(0) == []
    with pytest.raises(ValueError):
        allocator.alloc(-1)


def test_empty_tier():
    allocator = BlockAllocator(0)
    assert allocator.alloc(0) == [] and allocator.num_free == 0
    with pytest.raises(OutOfBlocksError):
        allocator.alloc(1)
    with pytest.raises(ValueError):
        BlockAllocator(-1)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 20), st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_random_alloc_free_keeps_accounting(total, steps):
    allocator = BlockAllocator(total)
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
