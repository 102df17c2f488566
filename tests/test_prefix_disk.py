"""The prefix cache manager's disk tier over the in-process fake bus: CPU
pressure spills to the disk in one task, a match that reaches the disk loads
it back (one load, then the one swap_in), disk pressure drops LRU disk
leaves, and every failure of spill and load leaves one owner per block and
never serves a lost block (zkv/prefix/swaps.py)."""

from __future__ import annotations

import pytest
from prefix_engine import BS, Engine, kv_of, prompt

from zkv.prefix import block_keys

FAILURES = ["failed", "cancelled", "rejected", "raise", "timeout", "died"]
LATE = ("timeout", "died")  # copies that may still land: their destinations held until they settle


def fill_to_disk(engine: Engine, first: int = 1, count: int = 5, blocks: int = 2) -> list[list[int]]:
    """Prompts served in turn, LRU first down the tiers: with GPU 4 + CPU 4 and 5 prompts
    of 2 blocks, the first is on the disk, the next two on the CPU, the last two on the GPU."""
    prompts = [prompt(seed, blocks) for seed in range(first, first + count)]
    for tokens in prompts:
        engine.serve(tokens)
    return prompts


def test_cpu_pressure_spills_to_the_disk_in_one_task_instead_of_dropping():
    engine = Engine()
    a, b, _, _, _ = fill_to_disk(engine)  # a: GPU -> CPU -> disk; b: GPU -> CPU
    assert engine.manager.locate(a) == ["disk", "disk"]
    assert engine.manager.locate(b) == ["cpu", "cpu"]
    spills = engine.bus.ops("spill")
    assert len(spills) == 1 and len(spills[0].src) == 2, "one spill task for the batch"
    stats = engine.stats()
    assert stats["spilled_blocks"] == 2 and stats["disk"]["used"] == 2
    assert stats["dropped_gpu_blocks"] == stats["dropped_cpu_blocks"] == stats["dropped_disk_blocks"] == 0
    assert [engine.bus.disk[block] for block in spills[0].dst] == [kv_of(k) for k in block_keys(a, BS)]


def test_a_match_that_reaches_the_disk_loads_then_swaps_in_and_serves_the_data_written():
    engine = Engine(gpu=4, cpu=4, disk=8)
    a, *_ = fill_to_disk(engine)
    loads, swap_ins = len(engine.bus.ops("load")), len(engine.bus.ops("swap_in"))
    cached = engine.serve(a)  # serve() checks the data
    assert (cached.gpu_hit_blocks, cached.cpu_hit_blocks, cached.disk_hit_blocks) == (0, 0, 2)
    assert len(engine.bus.ops("load")) == loads + 1 and len(engine.bus.ops("swap_in")) == swap_ins + 1
    assert engine.manager.locate(a) == ["gpu", "gpu"]
    stats = engine.stats()
    assert stats["loaded_blocks"] == 2 and stats["disk_hit_rate"] > 0
    assert stats["swaps"]["load"]["ok"] == 1 and stats["swaps"]["spill"]["ok"] >= 1


def test_a_match_runs_gpu_then_cpu_then_disk_blocks_in_one_load_and_one_swap_in():
    engine = Engine(gpu=6, cpu=4, disk=8)
    long, other = prompt(1, 6), prompt(2, 2)
    engine.serve(long)
    assert engine.manager.evict(4) == 4  # the 4 deepest to the CPU, which is full then
    engine.serve(other)
    engine.manager.release(engine.manager.match(long[: 2 * BS]))  # long's GPU blocks: more recent than other's
    assert engine.manager.evict(2) == 2  # other to the CPU, which spills long's 2 deepest to the disk
    assert engine.manager.locate(long) == ["gpu", "gpu", "cpu", "cpu", "disk", "disk"]
    before = len(engine.bus.submitted)
    cached = engine.serve(long)
    assert (cached.gpu_hit_blocks, cached.cpu_hit_blocks, cached.disk_hit_blocks) == (2, 2, 2)
    assert [task.op for task in engine.bus.submitted[before:]].count("swap_in") == 1
    assert [task.op for task in engine.bus.submitted[before:]].count("load") == 1


def test_disk_pressure_drops_the_lru_disk_leaves_and_nothing_before_the_disk_is_full():
    engine = Engine(gpu=2, cpu=2, disk=4)
    prompts = [prompt(seed, 2) for seed in range(1, 8)]
    for number, tokens in enumerate(prompts):
        engine.serve(tokens)
        stats = engine.stats()
        dropped = stats["dropped_gpu_blocks"] + stats["dropped_cpu_blocks"] + stats["dropped_disk_blocks"]
        assert dropped == 0 or stats["disk"]["peak_used"] == 4, f"dropped before the disk was full ({number})"
    stats = engine.stats()
    assert stats["dropped_disk_blocks"] > 0 and stats["dropped_cpu_blocks"] == stats["dropped_gpu_blocks"] == 0
    assert engine.manager.locate(prompts[0]) == [], "the oldest went first"
    assert engine.manager.locate(prompts[-3]) == ["disk", "disk"]
    engine.serve(prompts[-3])  # and still comes back right


def test_without_a_disk_tier_nothing_is_spilled_or_loaded():
    engine = Engine(disk=0)
    fill_to_disk(engine, count=5)
    assert not engine.bus.ops("spill") and not engine.bus.ops("load")
    assert engine.stats()["dropped_cpu_blocks"] > 0 and engine.stats()["disk"]["total"] == 0


def test_insert_adopts_a_gpu_copy_of_a_block_cached_on_the_disk():
    engine = Engine()
    a, *_ = fill_to_disk(engine)
    fresh = engine.manager.allocate(2)  # scheduled without a match: computed again
    on_disk = engine.stats()["disk"]["used"]
    result = engine.manager.insert(a, fresh.block_ids)
    assert (result.adopted_from_cpu, result.adopted_from_disk) == (0, 2)
    engine.manager.release(fresh)
    assert engine.stats()["disk"]["used"] == on_disk - 2 and engine.manager.locate(a) == ["gpu", "gpu"]
    engine.manager.check_invariants()


@pytest.mark.parametrize("outcome", FAILURES)
def test_a_failed_spill_drops_its_victims_and_quarantines_a_timed_out_ones_disk_blocks(outcome):
    engine = Engine()
    a, b, *_ = fill_to_disk(engine, count=4)  # a and b on the CPU, which is full
    engine.bus.script(outcome)  # the spill of a that makes room for the next swap-out
    engine.serve(prompt(5, 2))
    stats = engine.stats()
    counted = {"raise": "rejected", "died": "failed"}.get(outcome, outcome)
    assert stats["swaps"]["spill"][counted] == 1
    assert engine.manager.locate(a) == [], "dropped, not rolled back"
    assert engine.manager.locate(b) == ["cpu", "cpu"]
    assert stats["quarantined_blocks"]["disk"] == (2 if outcome in LATE else 0)
    assert stats["disk"]["used"] == stats["quarantined_blocks"]["disk"]
    engine.bus.deliver_late()
    engine.serve(prompt(6, 2))  # reaps the late outcome
    assert engine.stats()["quarantined_blocks"]["disk"] == 0
    engine.manager.check_invariants()


@pytest.mark.parametrize("outcome", ["cancelled", "rejected", "raise", "timeout"])
def test_a_load_that_does_not_end_ok_leaves_the_blocks_on_the_disk(outcome):
    engine = Engine()
    a, *_ = fill_to_disk(engine)
    engine.bus.script(outcome, op="load")
    cached = engine.manager.match(a)
    assert cached.num_blocks == 0
    engine.manager.release(cached)
    engine.manager.check_invariants()
    stats = engine.stats()
    assert engine.manager.locate(a) == ["disk", "disk"]
    assert stats["quarantined_blocks"]["cpu"] == (2 if outcome in LATE else 0)
    engine.bus.deliver_late()
    cached = engine.serve(a)  # retried, now ok
    assert cached.disk_hit_blocks == 2
    assert engine.stats()["quarantined_blocks"] == {"gpu": 0, "cpu": 0, "disk": 0}


def test_a_lost_disk_block_is_dropped_with_its_subtree_and_never_served():
    engine = Engine(gpu=4, cpu=4, disk=8)
    a = prompt(1, 2)
    a_longer = a + prompt(9, 1)
    engine.serve(a_longer)
    for seed in range(2, 6):  # a_longer's 3 blocks go down to the disk
        engine.serve(prompt(seed, 2))
    assert engine.manager.locate(a_longer) == ["disk"] * 3
    spilled = {record.dst[i]: record.src[i] for record in engine.bus.ops("spill") for i in range(len(record.src))}
    first_block = next(d for d in spilled if engine.bus.disk[d] == kv_of(block_keys(a, BS)[0]))
    engine.bus.lose_disk(first_block)
    cached = engine.manager.match(a_longer)
    assert cached.num_blocks == 0, "a block whose digest failed is never served"
    engine.manager.release(cached)
    stats = engine.stats()
    assert stats["swaps"]["load"]["failed"] == 1
    assert engine.manager.locate(a_longer) == [], "the lost block went with everything below it"
    assert stats["quarantined_blocks"]["cpu"] == 0
    engine.manager.check_invariants()
    engine.serve(a_longer)  # computed again from scratch
    assert engine.manager.locate(a_longer) == ["gpu"] * 3


def test_a_late_spill_copy_never_lands_in_a_reused_disk_block():
    engine = Engine(gpu=2, cpu=2, disk=2)
    first, second, third = prompt(1, 2), prompt(2, 2), prompt(3, 2)
    engine.serve(first)
    engine.serve(second)  # first -> CPU
    engine.bus.script("timeout")
    engine.serve(third)  # first's spill times out: dropped, its 2 disk blocks quarantined
    assert engine.stats()["quarantined_blocks"]["disk"] == 2 and engine.manager.locate(first) == []
    engine.serve(prompt(4, 2))  # second -> disk? No room: its CPU leaf is dropped instead
    assert engine.stats()["disk"]["used"] == 2 and engine.manager.locate(second) == []
    engine.bus.deliver_late()  # the slow rank writes the quarantined disk blocks now
    engine.serve(prompt(5, 2))  # reaps, then spills into the freed blocks
    engine.serve(prompt(6, 2))
    for tokens in (prompt(4, 2), prompt(5, 2)):
        if engine.manager.locate(tokens):
            engine.serve(tokens)  # serve() checks every block it gets back
    engine.manager.check_invariants()
