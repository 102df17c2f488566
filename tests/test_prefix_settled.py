"""Late settlement of timed-out swaps: the manager releases quarantined blocks
through ``bus.settled()`` when the bus has it (as zkv.client.Client does), and
polls for late outcomes only when it does not; plus the small reporting APIs."""

from __future__ import annotations

import pytest

from zkv.prefix import PrefixCacheManager
from zkv.testing.fakebus import FakeBus

BS = 4


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


class NoPollBus(FakeBus):
    """A bus whose poll must never be called: it would steal other callers' outcomes."""

    def poll(self, timeout: float = 0.0):
        raise AssertionError("the manager polled a bus that has settled()")


def cached_on_cpu(bus: FakeBus, gpu: int = 8, cpu: int = 8, blocks: int = 3):
    manager = PrefixCacheManager(bus, BS, gpu, cpu)
    tokens = prompt(1, blocks)
    fresh = manager.allocate(blocks)
    for position, block in enumerate(fresh.block_ids):
        bus.gpu[block] = ("kv", position)
    manager.insert(tokens, fresh.block_ids)
    manager.release(fresh)
    assert manager.evict(blocks) == blocks
    return manager, tokens


def time_out_a_swap_in(bus: FakeBus, manager: PrefixCacheManager, tokens: list[int]) -> None:
    bus.script("timeout")
    lease = manager.match(tokens)
    assert lease.num_blocks == 0
    manager.release(lease)
    assert manager.stats()["quarantined_blocks"]["gpu"] == 3 and manager.stats()["quarantined_tasks"] == 1


@pytest.mark.parametrize("entry", ["match", "allocate", "evict", "reclaim_quarantine"])
def test_settled_tasks_free_their_quarantine_at_the_next_call(entry):
    bus = NoPollBus()
    manager, tokens = cached_on_cpu(bus)
    time_out_a_swap_in(bus, manager, tokens)
    assert manager.reclaim_quarantine() == 0, "not settled yet"
    bus.deliver_late()
    if entry == "match":
        assert manager.match(tokens).cpu_hit_blocks == 3
    elif entry == "allocate":
        assert manager.allocate(8).num_blocks == 8  # needs the 3 quarantined blocks
    elif entry == "evict":
        manager.evict(1)
    else:
        assert manager.reclaim_quarantine() == 3
    stats = manager.stats()
    assert stats["quarantined_blocks"] == {"gpu": 0, "cpu": 0, "disk": 0} and stats["quarantined_tasks"] == 0
    assert stats["late_outcomes"] == 1 and stats["reclaimed_blocks"] == 3
    manager.check_invariants()


@pytest.mark.parametrize("settles", [True, False])
def test_a_late_copy_lands_in_quarantine_never_in_a_reused_block(settles):
    bus = FakeBus(settles=settles)
    assert callable(getattr(bus, "settled", None)) is settles
    manager, tokens = cached_on_cpu(bus, gpu=6, cpu=8)
    time_out_a_swap_in(bus, manager, tokens)
    other = manager.allocate(3)  # the only 3 free GPU blocks
    for block in other.block_ids:
        bus.gpu[block] = "mine"
    bus.deliver_late()  # the slow rank copies into the quarantined blocks only
    assert [bus.gpu[block] for block in other.block_ids] == ["mine"] * 3
    assert manager.reclaim_quarantine() == 3
    lease = manager.match(tokens)
    assert lease.cpu_hit_blocks == 3 and [bus.gpu[b] for b in lease.block_ids] == [("kv", i) for i in range(3)]
    manager.release(lease)
    manager.release(other)
    manager.check_invariants()


def test_settled_tasks_the_manager_does_not_know_are_ignored():
    class Stranger(FakeBus):
        def settled(self, timeout: float = 0.0):
            return [12345, *super().settled(timeout)]

    bus = Stranger()
    manager, tokens = cached_on_cpu(bus)
    time_out_a_swap_in(bus, manager, tokens)
    assert manager.reclaim_quarantine() == 0
    bus.deliver_late()
    assert manager.reclaim_quarantine() == 3
    manager.check_invariants()


def test_a_settled_that_raises_keeps_the_quarantine_for_later():
    class Flaky(FakeBus):
        broken = True

        def settled(self, timeout: float = 0.0):
            if self.broken:
                raise RuntimeError("socket closed")
            return super().settled(timeout)

    bus = Flaky()
    manager, tokens = cached_on_cpu(bus)
    time_out_a_swap_in(bus, manager, tokens)
    bus.deliver_late()
    assert manager.reclaim_quarantine() == 0
    assert manager.match(prompt(2, 1)).num_blocks == 0  # no exception escapes
    bus.broken = False
    assert manager.reclaim_quarantine() == 3
    manager.check_invariants()


def test_tasks_cut_short_by_a_clear_never_settle_and_the_reset_forgets_them():
    bus = FakeBus()
    manager, tokens = cached_on_cpu(bus)
    time_out_a_swap_in(bus, manager, tokens)
    bus.clear()
    manager.set_cleared()
    assert bus.deliver_late() == 0 and bus.settled() == []
    manager.resume(8, 8)
    assert manager.stats()["gpu"]["used"] == 0
    manager.check_invariants()


def test_swap_bytes_are_counted_per_op():
    bus = FakeBus(block_bytes=100)
    manager, tokens = cached_on_cpu(bus)
    manager.release(manager.match(tokens))
    swaps = manager.stats()["swaps"]
    assert swaps["swap_out"]["bytes"] == 300 and swaps["swap_in"]["bytes"] == 300


def test_locate_reports_each_cached_block_tier_without_touching_anything():
    bus = FakeBus()
    manager, tokens = cached_on_cpu(bus, blocks=3)
    submitted = len(bus.submitted)
    assert manager.locate(tokens) == ["cpu"] * 3
    assert manager.locate(tokens[: 2 * BS + 1]) == ["cpu"] * 2
    assert manager.locate(prompt(9, 2)) == []
    assert len(bus.submitted) == submitted and manager.stats()["lookups"] == 0
    manager.release(manager.match(tokens))
    assert manager.locate(tokens) == ["gpu"] * 3
    manager.set_cleared()
    assert manager.locate(tokens) == []
