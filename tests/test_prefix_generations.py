"""The prefix cache manager follows the bus's two generations (docs/protocol.md
§8.2, zkv/rows/loss.py): a move of ``gen`` alone drops what was on
the GPU and keeps what lies wholly on the CPU and the disk; a move of
``cpu_gen``, or of ``gen`` on a bus that names no ``cpu_gen``, resets it all;
a task during which a tier it touches was lost is taken as cancelled."""

from __future__ import annotations

import prefix_engine
import pytest
from prefix_engine import BS, prompt

from zkv.rows.loss import LOST_ALL, LOST_GPU, LOST_NONE, lost_between, moved_under
from zkv.testing.fakebus import GARBAGE, FakeBus


@pytest.mark.parametrize(
    ("before", "after", "lost"),
    [
        ((None, None), (None, None), LOST_NONE),  # a bus that tells no generation
        ((None, None), (3, 1), LOST_NONE),  # the first one heard of
        ((3, None), (3, 1), LOST_NONE),  # the CPU generation learned later
        ((3, 1), (3, 1), LOST_NONE),
        ((3, 1), (4, 1), LOST_GPU),
        ((3, 1), (4, 2), LOST_ALL),
        ((3, 1), (4, None), LOST_ALL),  # a move heard without a cpu_gen: both
        ((3, None), (4, None), LOST_ALL),  # a bus that names no cpu_gen
        ((3, None), (4, 1), LOST_ALL),  # no cpu_gen known before: cannot tell it stayed
    ],
)
def test_what_a_move_of_the_generations_lost(before, after, lost):
    assert lost_between(before, after) == lost


def test_spill_and_load_ignore_a_move_of_gen_alone_and_swaps_do_not():
    assert not moved_under("spill", (3, 1), (4, 1)) and not moved_under("load", (3, 1), (4, 1))
    assert moved_under("load", (3, 1), (4, 2)) and moved_under("spill", (3, None), (4, None))
    assert moved_under("swap_in", (3, 1), (4, 1)) and moved_under("swap_out", (3, 1), (4, 1))
    assert not moved_under("swap_in", (3, 1), (3, 1))


class Engine(prefix_engine.Engine):
    """The stand-in engine on a bus at generation 5 and CPU generation ``cpu_gen``."""

    def __init__(self, gpu: int = 8, cpu: int = 3, disk: int = 8, cpu_gen: int | None = 0) -> None:
        bus = FakeBus()
        bus.gen, bus.cpu_gen = 5, cpu_gen
        super().__init__(gpu, cpu, disk, bus=bus)

    def on_three_tiers(self) -> tuple[list[int], list[int], list[int]]:
        """Three prompts: on the GPU with its last block on the CPU, wholly on the CPU, wholly on the disk."""
        on_gpu, on_cpu, on_disk = prompt(1, 3), prompt(2, 2), prompt(3, 2)
        self.serve(on_disk)
        assert self.manager.evict(2) == 2  # on_disk -> CPU
        self.serve(on_gpu)
        assert self.manager.evict(1) == 1  # on_gpu's last block -> CPU, which is full then
        self.serve(on_cpu)
        self.manager.release(self.manager.match(on_gpu[: 2 * BS]))  # on_gpu's GPU blocks: the recent ones
        assert self.manager.evict(2) == 2  # on_cpu -> CPU, which spills on_disk (the LRU CPU leaves)
        assert self.manager.locate(on_gpu) == ["gpu", "gpu", "cpu"]
        assert self.manager.locate(on_cpu) == ["cpu", "cpu"] and self.manager.locate(on_disk) == ["disk", "disk"]
        return on_gpu, on_cpu, on_disk


def test_a_move_of_gen_alone_drops_the_gpu_nodes_and_keeps_what_lies_wholly_off_the_gpu():
    engine = Engine()
    on_gpu, on_cpu, on_disk = engine.on_three_tiers()
    held = engine.manager.match(on_gpu[: 2 * BS])  # a request in flight across the move
    private = engine.manager.allocate(1)
    engine.bus.move_gen()  # e.g. a rank restarted and re-attached its CPU tier
    assert engine.manager.match(on_gpu).num_blocks == 0
    assert engine.manager.locate(on_gpu) == [], "its CPU block went too: a child without its prefix"
    stats = engine.manager.stats()
    assert (stats["gpu_generation_drops"], stats["generation_resets"]) == (1, 0)
    assert stats["gpu"]["used"] == 0 and stats["cpu"]["used"] == 2 and stats["disk"]["used"] == 2
    engine.manager.release(held)  # stale: a no-op
    engine.manager.release(private)
    engine.manager.check_invariants()
    cpu_hit = engine.serve(on_cpu)  # serve() checks the data
    disk_hit = engine.serve(on_disk)
    assert cpu_hit.cpu_hit_blocks == 2 and disk_hit.disk_hit_blocks == 2


@pytest.mark.parametrize("how", ["cpu_gen moved", "a bus without cpu_gen"])
def test_a_move_of_cpu_gen_or_of_gen_without_one_resets_every_tier(how):
    engine = Engine(cpu_gen=0 if how == "cpu_gen moved" else None)
    on_gpu, on_cpu, on_disk = engine.on_three_tiers()
    if how == "cpu_gen moved":
        engine.bus.move_cpu_gen()
    else:
        engine.bus.move_gen()
    assert engine.manager.match(on_cpu).num_blocks == 0
    assert [engine.manager.locate(t) for t in (on_gpu, on_cpu, on_disk)] == [[], [], []]
    stats = engine.manager.stats()
    assert (stats["gpu_generation_drops"], stats["generation_resets"]) == (0, 1)
    assert stats["cpu"]["used"] == stats["disk"]["used"] == 0
    engine.manager.check_invariants()


def test_a_load_during_which_gen_moved_is_kept_but_the_match_serves_nothing_of_the_old_gpu():
    engine = Engine()
    on_gpu, _, on_disk = engine.on_three_tiers()
    engine.bus.script("ok+gen", op="load")
    lease = engine.manager.match(on_disk)
    assert lease.num_blocks == 0, "the GPU it would land on is of a generation the tree has not followed"
    assert engine.manager.stats()["swaps"]["load"]["ok"] == 1
    assert engine.manager.locate(on_disk) == ["cpu", "cpu"], "the load kept: CPU and disk were not lost"
    assert engine.manager.locate(on_gpu) == []
    engine.manager.check_invariants()
    assert engine.serve(on_disk).cpu_hit_blocks == 2


def test_a_load_during_which_cpu_gen_moved_is_cancelled():
    engine = Engine()
    _, _, on_disk = engine.on_three_tiers()
    engine.bus.script("ok+cpu_gen", op="load")
    assert engine.manager.match(on_disk).num_blocks == 0
    stats = engine.manager.stats()
    assert stats["swaps"]["load"]["cancelled"] == 1 and stats["generation_resets"] == 1
    assert engine.manager.locate(on_disk) == []
    engine.manager.check_invariants()


def test_a_spill_during_which_gen_moved_is_kept():
    engine = Engine(cpu=2)
    first, second = prompt(1, 2), prompt(2, 2)
    engine.serve(first)
    assert engine.manager.evict(2) == 2  # first wholly on the CPU, which is full
    engine.serve(second)
    engine.bus.script("ok+gen", op="spill")
    assert engine.manager.evict(2) == 2  # second's swap-out needs room: first is spilled, then gen moves
    stats = engine.manager.stats()
    assert stats["swaps"]["spill"]["ok"] == 1 and stats["swaps"]["swap_out"]["cancelled"] == 1
    assert engine.manager.locate(first) == ["disk", "disk"]
    assert engine.serve(first).disk_hit_blocks == 2, "the spilled copy survived the GPU's generation"
    assert engine.manager.stats()["gpu_generation_drops"] == 1


def test_a_gpu_generation_move_forgets_gpu_quarantine_and_keeps_the_cpu_and_disk_quarantine():
    engine = Engine(gpu=8, cpu=2, disk=8)
    tokens, other = prompt(1, 2), prompt(2, 2)
    engine.serve(tokens)
    assert engine.manager.evict(2) == 2
    engine.bus.script("timeout", op="swap_in")
    assert engine.manager.match(tokens).num_blocks == 0  # its GPU blocks quarantined
    engine.serve(other)
    engine.bus.script("timeout", op="spill")
    assert engine.manager.evict(2) == 2  # tokens' spill times out: its disk blocks quarantined
    assert engine.manager.stats()["quarantined_blocks"] == {"gpu": 2, "cpu": 0, "disk": 2}
    engine.bus.move_gen()
    engine.manager.evict(1)  # follows the move
    assert engine.manager.stats()["quarantined_blocks"] == {"gpu": 0, "cpu": 0, "disk": 0}, "settled by the move"
    engine.manager.check_invariants()
    assert engine.serve(other).cpu_hit_blocks == 2
    assert GARBAGE not in [engine.bus.gpu[b] for b in engine.manager.match(other).block_ids]
