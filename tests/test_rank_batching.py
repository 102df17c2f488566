"""The rank's batching and inline policies alone, on a fake clock (numbers, no sleeping)."""

from zkv.rank.batching import DONES_HOLD_S, INLINE_MAX_BODY, DoneBatcher, InlinePolicy
from zkv.wire import bounds
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=64, block_size=4, kv_heads=2, head_dim=8)


def test_dones_of_one_wakeup_are_held_until_the_loop_flushes():
    b = DoneBatcher()
    assert not b.add(b"d1", 10.0) and not b.add(b"d2", 10.0001)
    assert not b.due(10.0002) and b.take() == [b"d1", b"d2"] and b.frames == []


def test_a_done_waits_for_company_at_most_the_hold_time():
    b = DoneBatcher(hold_s=0.001)
    assert not b.add(b"d1", 5.0)
    assert not b.due(5.0009) and b.due(5.001), "held since the first frame, not the last"
    assert b.add(b"d2", 5.001), "the frame that comes after the hold flushes the batch"
    b.take()
    assert not b.due(99.0), "nothing held: nothing due, however late"
    assert not b.add(b"d3", 99.0), "the hold starts again with the next first frame"


def test_a_full_batch_flushes_at_once():
    b = DoneBatcher(hold_s=1.0, limit=3)
    assert [b.add(b"d", 0.0) for _ in range(3)] == [False, False, True]
    assert DoneBatcher().limit == bounds.MAX_BATCH and DoneBatcher().hold_s == DONES_HOLD_S


def body(n: int) -> bytes:
    return P.encode_body("swap_out", list(range(n)), list(range(n)))


def test_small_tasks_run_inline_only_while_nothing_is_queued():
    policy = InlinePolicy()
    assert policy.inline(body(1), LAYOUT)
    policy.queued = 1
    assert not policy.inline(body(1), LAYOUT), "behind queued work: FIFO with it"
    policy.queued = 0
    assert policy.inline(body(1), LAYOUT)


def test_the_size_bound_follows_the_layout_and_the_body():
    policy = InlinePolicy()
    assert not policy.inline(b"x" * (INLINE_MAX_BODY + 1), LAYOUT), "a big body always goes to the executor"
    mib = LAYOUT.with_changes(layers=16, kv_heads=8, head_dim=128, block_size=16)  # 1 MiB a block: 8 fit the bound
    assert mib.block_bytes == 1 << 20
    assert policy.inline(body(4), mib)
    assert not policy.inline(body(16), mib), "16 MiB would stall the loop"
    assert policy.inline(body(16), LAYOUT)
