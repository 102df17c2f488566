"""A tree node per run of blocks serves exactly as a node per block would.

The same random workload (shared prefixes, leases held across requests, two
leases' blocks in one insert, scripted failures and timeouts, late copies,
lost disk blocks, generation moves, clears) drives two managers, each on its
own fake bus: one that keeps a request's blocks in one node (the default) and
one capped at a node per block (``max_run=1``).  Every task they submit (op,
blocks, outcome), every lease, insert result, eviction, ``locate`` answer and
stat must be the same, step by step, and both keep their invariants.
"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from zkv.prefix import PrefixCacheManager, block_keys
from zkv.testing.fakebus import FakeBus

BS = 4
LONG = os.environ.get("ZKV_LONG_MODEL") == "1"
OUTCOMES = st.lists(st.sampled_from(["ok"] * 6 + ["failed", "cancelled", "rejected", "raise", "timeout"]), max_size=3)
STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("serve"),
            st.integers(0, 2),  # which shared prefix
            st.integers(0, 30),  # the rest of the prompt
            st.integers(1, 5),  # its blocks
            st.integers(0, 3),  # a partial block's tokens
            st.booleans(),  # leases kept for later
            st.booleans(),  # fresh blocks from two allocate() calls
            OUTCOMES,
        ),
        st.tuples(st.just("evict"), st.integers(1, 6), OUTCOMES),
        st.tuples(st.just("release"), st.integers(0, 100)),
        st.tuples(st.just("late")),
        st.tuples(st.just("lose"), st.integers(0, 12)),
        st.tuples(st.just("gen"), st.sampled_from(["gen", "cpu_gen"])),
        st.tuples(st.just("drained")),
        st.tuples(st.just("clear")),
        st.tuples(st.just("locate"), st.integers(0, 2), st.integers(0, 30), st.integers(1, 5)),
    ),
    min_size=10,
    max_size=80,
)
PREFIXES = [[p * 7919 + i for i in range(p * 2 * BS)] for p in range(3)]  # 0, 2 and 4 shared blocks


class Side:
    """One manager on its own fake bus, and what it said at each step."""

    def __init__(self, tiers: tuple[int, int, int], max_run: int | None) -> None:
        gpu, cpu, disk = tiers
        self.bus = FakeBus()
        self.bus.gen = self.bus.cpu_gen = 0  # a bus that names its generations, so a move is seen
        self.manager = PrefixCacheManager(self.bus, BS, gpu, cpu, num_disk_blocks=disk, max_run=max_run)
        self.tiers = tiers
        self.held: list[list] = []

    def serve(self, tokens: list[int], keep: bool, two_leases: bool) -> tuple:
        manager, keys = self.manager, block_keys(tokens, BS)
        try:
            cached = manager.match(tokens)
            need = -(-len(tokens) // BS) - cached.num_blocks
            fresh = [manager.allocate(need // 2), manager.allocate(need - need // 2)] if two_leases else []
            fresh = fresh or [manager.allocate(need)]
            fresh_ids = [block for lease in fresh for block in lease.block_ids]
        except Exception as exc:  # noqa: BLE001 - both sides must raise the same
            return ("raised", type(exc).__name__)
        for position, block in enumerate(fresh_ids, start=cached.num_blocks):
            self.bus.gpu[block] = ("kv", keys[position]) if position < len(keys) else ("partial",)
        served = [self.bus.gpu.get(block) for block in cached.block_ids]
        assert served == [("kv", key) for key in keys[: cached.num_blocks]], "a match served another prefix's data"
        inserted = manager.insert(tokens, cached.block_ids + fresh_ids[: len(keys) - cached.num_blocks], cached.keys)
        leases = [cached, *fresh]
        if keep:
            self.held.append(leases)
        else:
            for lease in leases:
                manager.release(lease)
        hits = (cached.gpu_hit_blocks, cached.cpu_hit_blocks, cached.disk_hit_blocks)
        return (cached.block_ids, hits, fresh_ids, inserted)

    def step(self, step: tuple) -> object:
        kind, manager, bus = step[0], self.manager, self.bus
        if kind == "serve":
            _, prefix, seed, blocks, extra, keep, two_leases, outcomes = step
            bus.script(*outcomes)
            tokens = PREFIXES[prefix] + [seed * 1000 + i for i in range(blocks * BS + extra)]
            return self.serve(tokens, keep, two_leases)
        if kind == "evict":
            bus.script(*step[2])
            return manager.evict(step[1])
        if kind == "release" and self.held:
            for lease in self.held.pop(step[1] % len(self.held)):
                manager.release(lease)
        elif kind == "late":
            return bus.deliver_late()
        elif kind == "lose":
            bus.lose_disk(step[1])
        elif kind == "gen":
            bus.move_gen() if step[1] == "gen" else bus.move_cpu_gen()
        elif kind == "drained":
            return manager.on_bus_drained()
        elif kind == "clear":
            bus.clear()
            manager.set_cleared()
            manager.resume(*self.tiers[:2])
            self.held.clear()
        elif kind == "locate":
            _, prefix, seed, blocks = step
            return manager.locate(PREFIXES[prefix] + [seed * 1000 + i for i in range(blocks * BS)])
        return None

    def tasks(self) -> list[tuple]:
        return [(task.op, task.src, task.dst, task.outcome) for task in self.bus.submitted]

    def stats(self) -> dict:
        return {key: value for key, value in self.manager.stats().items() if key != "nodes"}


@settings(max_examples=1000 if LONG else 150, deadline=None)
@given(
    st.tuples(st.integers(3, 12), st.sampled_from([0, 2, 4, 8, 16]), st.sampled_from([0, 0, 4, 8, 12])),
    STEPS,
)
def test_a_node_per_run_serves_as_a_node_per_block(tiers, steps):
    runs, blocks = Side(tiers, max_run=None), Side(tiers, max_run=1)
    for number, step in enumerate(steps):
        said = runs.step(step), blocks.step(step)
        assert said[0] == said[1], f"step {number} {step}: runs said {said[0]}, blocks {said[1]}"
        assert runs.tasks() == blocks.tasks(), f"step {number} {step}: the tasks differ"
        assert runs.stats() == blocks.stats(), f"step {number} {step}: the stats differ"
        runs.manager.check_invariants()
        blocks.manager.check_invariants()
    per_block = blocks.manager.stats()
    assert sum(per_block["nodes"].values()) == sum(per_block["blocks"].values()), "max_run=1: a node per block"
