"""Prefix cache manager over the in-process fake bus: hits, leases, eviction,
swap failures, the clear cycle, and a random workload checked after every step."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zkv.harness.prefix.bench import bench_manager
from zkv.prefix import (
    BlockLease,
    CacheClearedError,
    InvalidBlockError,
    InvalidLeaseError,
    OutOfGpuBlocksError,
    PrefixCacheManager,
    block_keys,
)
from zkv.testing.fakebus import FakeBus

BS = 4
FAILURES = ["failed", "cancelled", "rejected", "raise", "timeout", "died"]
#: outcomes whose copies may still land: their destination blocks are held until the task settles
LATE = ("timeout", "died")


def prompt(seed: int, blocks: int, extra: int = 0) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS + extra)]


def kv_of(key: bytes) -> tuple[str, str]:
    """What the 'engine' writes into a block: derived from the block's whole prefix."""
    return ("kv", key.hex())


class Engine:
    """Drives the manager like a scheduler would and writes block contents into the fake GPU."""

    def __init__(self, gpu: int = 8, cpu: int = 8, **kwargs) -> None:
        self.bus = FakeBus()
        self.manager = PrefixCacheManager(self.bus, BS, gpu, cpu, **kwargs)

    def serve(self, tokens: list[int]) -> tuple[BlockLease, BlockLease]:
        """match + allocate + compute + insert; returns the two leases still held."""
        cached = self.manager.match(tokens)
        self.assert_content(tokens, cached.block_ids)
        fresh = self.manager.allocate(-(-len(tokens) // BS) - cached.num_blocks)
        keys = block_keys(tokens, BS)
        for position, block in enumerate(fresh.block_ids, start=cached.num_blocks):
            self.bus.gpu[block] = kv_of(keys[position]) if position < len(keys) else ("partial",)
        self.manager.insert(tokens, cached.block_ids + fresh.block_ids[: len(keys) - cached.num_blocks])
        return cached, fresh

    def serve_and_finish(self, tokens: list[int]) -> None:
        for lease in self.serve(tokens):
            self.manager.release(lease)
        self.manager.check_invariants()

    def assert_content(self, tokens: list[int], block_ids: list[int]) -> None:
        keys = block_keys(tokens, BS)
        assert [self.bus.gpu.get(block) for block in block_ids] == [kv_of(key) for key in keys[: len(block_ids)]]


def test_miss_then_hit_on_the_same_blocks():
    engine = Engine()
    tokens = prompt(1, 3, extra=2)
    cached, fresh = engine.serve(tokens)
    assert cached.block_ids == [] and fresh.num_blocks == 4
    engine.manager.check_invariants()
    again = engine.manager.match(tokens)
    assert again.block_ids == fresh.block_ids[:3] and again.gpu_hit_blocks == 3
    for lease in (cached, fresh, again):
        engine.manager.release(lease)
    engine.manager.check_invariants()
    stats = engine.manager.stats()
    assert stats["gpu"] == {"total": 8, "used": 3, "free": 5, "peak_used": 4, "reserved": 0}
    assert stats["gpu_hit_rate"] == 0.5 and stats["cpu_hit_rate"] == 0.0


def test_match_covers_full_blocks_only_and_stops_at_divergence():
    engine = Engine()
    engine.serve_and_finish(prompt(1, 3))
    assert engine.manager.match(prompt(1, 2, extra=3)).num_blocks == 2
    diverged = prompt(1, 3)
    diverged[5] = -1  # inside block 1
    assert engine.manager.match(diverged).num_blocks == 1
    assert engine.manager.match(prompt(2, 3)).num_blocks == 0


def test_referenced_blocks_are_never_evicted():
    engine = Engine(gpu=4, cpu=4)
    cached, fresh = engine.serve(prompt(1, 3))
    engine.manager.release(cached)  # fresh still references the 3 inserted blocks
    with pytest.raises(OutOfGpuBlocksError):
        engine.manager.allocate(2)
    assert engine.bus.submitted == []
    engine.manager.release(fresh)
    engine.manager.allocate(2)
    engine.manager.check_invariants()


def test_release_twice_raises():
    engine = Engine()
    lease = engine.manager.allocate(1)
    engine.manager.release(lease)
    with pytest.raises(InvalidLeaseError):
        engine.manager.release(lease)


def test_insert_validates_before_changing_anything():
    engine = Engine()
    tokens = prompt(1, 2)
    engine.serve_and_finish(tokens)
    stranger = prompt(2, 2)
    owned = engine.manager.allocate(2)
    tree_block = engine.manager.match(tokens).block_ids[0]
    with pytest.raises(InvalidBlockError):
        engine.manager.insert(stranger, [owned.block_ids[0], tree_block])  # a block the tree owns
    with pytest.raises(InvalidBlockError):
        engine.manager.insert(stranger, [7, 6])  # free blocks
    with pytest.raises(InvalidBlockError):
        engine.manager.insert(stranger, owned.block_ids + [5])  # more ids than full blocks
    with pytest.raises(InvalidBlockError):
        engine.manager.insert(stranger, [owned.block_ids[0]] * 2)
    assert engine.manager.match(stranger).num_blocks == 0


def test_duplicate_insert_keeps_the_cached_block_and_frees_the_copy_at_release():
    engine = Engine()
    tokens = prompt(1, 2)
    first_cached, first = engine.serve(tokens)
    second = engine.manager.allocate(2)  # computed concurrently, before the first inserted
    result = engine.manager.insert(tokens, second.block_ids)
    assert (result.new_blocks, result.duplicate_blocks) == (0, 2)
    assert engine.manager.stats()["gpu"]["used"] == 4  # the copy stays the caller's until release
    engine.manager.check_invariants()
    engine.manager.release(second)
    assert engine.manager.stats()["gpu"]["used"] == 2
    assert engine.manager.match(tokens).block_ids == first.block_ids
    engine.manager.release(first_cached)
    engine.manager.release(first)
    engine.manager.check_invariants()


def test_insert_adopts_a_gpu_copy_of_a_block_cached_on_cpu():
    engine = Engine(gpu=4, cpu=4)
    tokens = prompt(1, 2)
    engine.serve_and_finish(tokens)
    assert engine.manager.evict(2) == 2
    assert engine.manager.stats()["cpu"]["used"] == 2
    fresh = engine.manager.allocate(2)  # e.g. the request was scheduled without a match
    result = engine.manager.insert(tokens, fresh.block_ids)
    assert result.adopted_from_cpu == 2
    assert engine.manager.stats()["cpu"]["used"] == 0
    engine.manager.release(fresh)
    assert engine.manager.match(tokens).block_ids == fresh.block_ids
    engine.manager.check_invariants()


def test_eviction_is_lru_and_deepest_first():
    engine = Engine(gpu=6, cpu=6)
    a, b = prompt(1, 3), prompt(2, 3)
    engine.serve_and_finish(a)
    engine.serve_and_finish(b)
    b_lease = engine.manager.match(b)
    b_blocks = b_lease.block_ids
    engine.manager.release(b_lease)
    engine.manager.release(engine.manager.match(a))  # a is now more recent than b
    engine.manager.evict(1)
    assert engine.bus.ops("swap_out")[-1].src == (b_blocks[2],)
    engine.manager.evict(2)
    assert engine.bus.ops("swap_out")[-1].src == (b_blocks[0], b_blocks[1])  # one task, parents first
    assert engine.manager.match(a).gpu_hit_blocks == 3
    engine.manager.check_invariants()


def test_an_eviction_across_chains_takes_the_older_chain_whole_then_the_deepest_of_the_next():
    engine = Engine(gpu=8, cpu=8)
    chains = []
    for seed in (1, 2):  # the first prompt's blocks are the least recently used
        cached, fresh = engine.serve(prompt(seed, 3))
        chains.append(fresh.block_ids[:3])
        for lease in (cached, fresh):
            engine.manager.release(lease)
    (a0, a1, a2), (b0, b1, b2) = chains
    assert engine.manager.evict(5) == 5
    assert engine.bus.ops("swap_out")[-1].src == (a0, a1, b1, a2, b2)  # one task, parents first
    assert engine.manager.match(prompt(2, 3)).gpu_hit_blocks == 1  # b0 stayed: it was the newest candidate
    engine.manager.check_invariants()


def test_swap_out_then_swap_in_round_trips_data_in_one_task():
    engine = Engine(gpu=8, cpu=8)
    tokens = prompt(1, 4)
    engine.serve_and_finish(tokens)
    assert engine.manager.evict(2) == 2  # the two deepest blocks go to the CPU
    swap_outs_before = len(engine.bus.ops("swap_out"))
    cached = engine.manager.match(tokens)
    assert (cached.gpu_hit_blocks, cached.cpu_hit_blocks) == (2, 2)
    swap_ins = engine.bus.ops("swap_in")
    assert len(swap_ins) == 1 and len(swap_ins[0].src) == 2
    assert len(engine.bus.ops("swap_out")) == swap_outs_before
    engine.assert_content(tokens, cached.block_ids)
    engine.manager.check_invariants()
    stats = engine.manager.stats()
    assert stats["swaps"]["swap_in"]["ok"] == 1 and stats["swaps"]["swap_out"]["ok"] == 1
    assert stats["cpu"]["used"] == 0


def test_swap_in_evicts_other_leaves_when_the_gpu_is_full():
    engine = Engine(gpu=4, cpu=8)
    a, b = prompt(1, 4), prompt(2, 4)
    engine.serve_and_finish(a)
    engine.serve_and_finish(b)  # pushes a to the CPU
    cached = engine.manager.match(a)  # pushes b to the CPU, brings a back
    assert cached.cpu_hit_blocks == 4
    engine.assert_content(a, cached.block_ids)
    engine.manager.release(cached)
    cached = engine.manager.match(b)
    assert cached.cpu_hit_blocks == 4
    engine.assert_content(b, cached.block_ids)
    engine.manager.check_invariants()


@pytest.mark.parametrize("outcome", FAILURES)
def test_failed_swap_out_drops_the_victims_without_leaking(outcome):
    engine = Engine(gpu=4, cpu=4)
    tokens = prompt(1, 3)
    engine.serve_and_finish(tokens)
    engine.bus.script(outcome)
    lease = engine.manager.allocate(4)  # needs the cached blocks' GPU room
    engine.manager.check_invariants()
    stats = engine.manager.stats()
    assert stats["gpu"]["used"] == 4 and stats["blocks"]["ON_GPU"] == stats["blocks"]["ON_CPU"] == 0
    counted = {"raise": "rejected", "died": "failed"}.get(outcome, outcome)
    assert stats["swaps"]["swap_out"][counted] == 1
    assert stats["quarantined_blocks"]["cpu"] == (3 if outcome in LATE else 0)
    engine.bus.deliver_late()
    engine.manager.release(lease)
    assert engine.manager.match(tokens).num_blocks == 0  # also reaps the late outcome
    assert engine.manager.stats()["cpu"]["used"] == 0
    engine.manager.check_invariants()


@pytest.mark.parametrize("outcome", FAILURES)
def test_failed_swap_in_leaves_the_blocks_on_cpu(outcome):
    engine = Engine(gpu=8, cpu=8)
    tokens = prompt(1, 4)
    engine.serve_and_finish(tokens)
    engine.manager.evict(3)
    engine.bus.script(outcome)
    cached = engine.manager.match(tokens)
    assert (cached.gpu_hit_blocks, cached.cpu_hit_blocks, cached.num_blocks) == (1, 0, 1)
    engine.manager.check_invariants()
    stats = engine.manager.stats()
    assert stats["blocks"]["ON_CPU"] == 3 and stats["cpu"]["used"] == 3
    assert stats["gpu"]["used"] == 1 + (3 if outcome in LATE else 0)
    engine.manager.release(cached)
    engine.bus.deliver_late()
    cached = engine.manager.match(tokens)  # retried, now ok
    assert cached.cpu_hit_blocks == 3
    engine.assert_content(tokens, cached.block_ids)
    engine.manager.release(cached)
    assert engine.manager.stats()["gpu"]["used"] == 4
    engine.manager.check_invariants()


def test_a_late_copy_of_a_timed_out_swap_never_lands_in_a_reused_block():
    engine = Engine(gpu=8, cpu=8)
    tokens = prompt(1, 4)
    engine.serve_and_finish(tokens)
    engine.manager.evict(4)
    engine.bus.script("timeout")
    assert engine.manager.match(tokens).num_blocks == 0
    other = prompt(2, 4)
    held = engine.serve(other)  # takes the 4 blocks that are not quarantined
    with pytest.raises(OutOfGpuBlocksError):
        engine.manager.allocate(1)
    engine.bus.deliver_late()  # the slow rank finally copies into the quarantined blocks
    engine.assert_content(other, engine.manager.match(other).block_ids)
    assert engine.manager.stats()["quarantined_blocks"] == {"gpu": 0, "cpu": 0, "disk": 0}
    engine.manager.check_invariants()
    for lease in held:
        engine.manager.release(lease)


def test_a_late_swap_out_copy_never_lands_in_a_reused_cpu_block():
    engine = Engine(gpu=2, cpu=2)
    first, second = prompt(1, 2), prompt(2, 2)
    engine.serve_and_finish(first)
    engine.bus.script("timeout")
    engine.serve_and_finish(second)  # first's swap-out times out: dropped, its CPU blocks quarantined
    assert engine.manager.stats()["quarantined_blocks"]["cpu"] == 2
    engine.manager.evict(2)  # second goes to the CPU: no free CPU block, no CPU leaf, so dropped
    assert engine.manager.match(second).num_blocks == 0
    engine.bus.deliver_late()
    engine.serve_and_finish(second)  # reaps the late outcome
    engine.manager.evict(2)
    cached = engine.manager.match(second)
    assert cached.cpu_hit_blocks == 2
    engine.assert_content(second, cached.block_ids)
    engine.manager.check_invariants()


def test_a_wait_that_raises_counts_as_a_timeout():
    class BrokenWait(FakeBus):
        def wait(self, task, timeout=None):
            raise RuntimeError("socket closed")

    engine = Engine(gpu=4, cpu=4)
    engine.bus = BrokenWait()
    engine.manager = PrefixCacheManager(engine.bus, BS, 4, 4)
    engine.serve_and_finish(prompt(1, 2))
    engine.manager.evict(2)
    stats = engine.manager.stats()
    assert stats["swaps"]["swap_out"]["timeout"] == 1 and stats["quarantined_blocks"]["cpu"] == 2
    engine.manager.check_invariants()


def test_a_drained_bus_frees_the_quarantine():
    engine = Engine(gpu=8, cpu=8)
    tokens = prompt(1, 3)
    engine.serve_and_finish(tokens)
    engine.manager.evict(3)
    engine.bus.script("timeout")
    engine.manager.match(tokens)
    assert engine.manager.stats()["quarantined_blocks"] == {"gpu": 3, "cpu": 0, "disk": 0}
    assert engine.manager.on_bus_drained() == 3  # e.g. after a pause: the late copy can no longer land
    assert engine.manager.stats()["gpu"]["used"] == 0
    engine.manager.check_invariants()
    assert engine.manager.match(tokens).cpu_hit_blocks == 3


def test_without_quarantine_timed_out_blocks_are_freed_at_once():
    with pytest.warns(DeprecationWarning, match="quarantine_timed_out"):
        engine = Engine(gpu=8, cpu=8, quarantine_timed_out=False)
    tokens = prompt(1, 4)
    engine.serve_and_finish(tokens)
    engine.manager.evict(4)
    engine.bus.script("timeout")
    engine.manager.match(tokens)
    assert engine.manager.stats()["gpu"]["used"] == 0
    engine.manager.check_invariants()


def test_cpu_pressure_drops_the_oldest_cpu_leaves():
    engine = Engine(gpu=4, cpu=4)
    prompts = [prompt(seed, 2) for seed in range(5)]
    for tokens in prompts:
        engine.serve_and_finish(tokens)
    stats = engine.manager.stats()
    assert stats["cpu"]["used"] == 4 and stats["dropped_cpu_blocks"] == 2
    assert {k: v for k, v in stats["blocks"].items() if v} == {"ON_GPU": 4, "ON_CPU": 4}
    assert engine.manager.match(prompts[0]).num_blocks == 0
    cached = engine.manager.match(prompts[1])
    assert cached.cpu_hit_blocks == 2
    engine.assert_content(prompts[1], cached.block_ids)
    engine.manager.check_invariants()


def test_without_cpu_space_gpu_leaves_are_simply_dropped():
    engine = Engine(gpu=4, cpu=0)
    engine.serve_and_finish(prompt(1, 4))
    engine.serve_and_finish(prompt(2, 4))
    assert engine.bus.submitted == []
    assert engine.manager.stats()["dropped_gpu_blocks"] == 4
    engine.manager.check_invariants()


def test_clear_degrades_to_no_hit_and_resume_serves_a_new_layout():
    engine = Engine(gpu=8, cpu=8)
    tokens = prompt(1, 3)
    engine.serve_and_finish(tokens)
    held = engine.serve(prompt(2, 2))
    engine.manager.evict(3)
    submitted = len(engine.bus.submitted)

    engine.bus.clear()
    engine.manager.set_cleared()
    assert engine.manager.match(tokens).num_blocks == 0
    with pytest.raises(CacheClearedError):
        engine.manager.allocate(1)
    assert engine.manager.insert(tokens, [0]).new_blocks == 0
    for lease in held:
        engine.manager.release(lease)  # stale: a no-op
    assert engine.manager.evict(4) == 0
    assert len(engine.bus.submitted) == submitted  # clearing talks to no one
    engine.manager.check_invariants()
    assert engine.manager.stats()["gpu"] == {"total": 0, "used": 0, "free": 0, "peak_used": 0, "reserved": 0}

    engine.manager.resume(num_gpu_blocks=16, num_cpu_blocks=4, block_size=BS)
    assert engine.manager.match(tokens).num_blocks == 0
    engine.serve_and_finish(tokens)
    cached = engine.manager.match(tokens)
    assert cached.gpu_hit_blocks == 3
    engine.assert_content(tokens, cached.block_ids)
    engine.manager.check_invariants()
    assert engine.manager.stats()["gpu"]["total"] == 16


def test_reset_keeps_the_quarantine_until_the_late_copy_settles():
    """A reset waits on nothing, yet never hands out a row a late copy may still
    write: the quarantine carries over into the new epoch's rows."""
    engine = Engine()
    tokens = prompt(1, 2)
    engine.serve_and_finish(tokens)
    engine.manager.evict(2)
    engine.bus.script("timeout")
    engine.manager.match(tokens)
    assert engine.manager.stats()["quarantined_blocks"]["gpu"] == 2
    engine.manager.reset()
    assert engine.manager.stats()["quarantined_blocks"]["gpu"] == 2
    assert engine.manager.stats()["gpu"]["used"] == 2, "held rows are not free to hand out"
    engine.manager.check_invariants()
    engine.bus.deliver_late()
    assert engine.manager.reclaim_quarantine() == 2
    assert engine.manager.stats()["gpu"]["used"] == 0
    engine.manager.check_invariants()


def test_bench_reports_microseconds_per_request():
    figures = bench_manager(n_requests=24, prompt_tokens=256, block_size=16, gpu_requests=2, cpu_requests=4)
    assert figures["us_per_request"] > 0 and figures["requests"] == 24
    assert figures["fake_bus_us"] > 0, "the swaps went through the bus, whose time is taken out"
    assert figures["us_per_request_with_bus"] == pytest.approx(figures["us_per_request"] + figures["fake_bus_us"])
    assert figures["cpu_hit_rate"] > 0 and figures["swaps"]["swap_in"]["ok"] > 0


# --------------------------------------------------------------- random workload

# ZKV_LONG_MODEL=1: the long profile of the model-based tests (as tests/test_bus_model.py)
LONG = os.environ.get("ZKV_LONG_MODEL") == "1"
#: outcomes of the tasks a step issues (swaps, spills, loads), some moving the bus's generations meanwhile
SWAP_OUTCOMES = st.lists(
    st.sampled_from(
        ["ok"] * 8 + FAILURES + ["timeout", "died", "ok+gen", "ok+cpu_gen", "timeout+gen", "died+gen", "failed+gen"]
    ),
    max_size=3,
)
#: how the bus names its generations: not at all (a test double), gen only (an older broker), both
GEN_MODES = st.sampled_from(["none", "gen", "both"])


class RandomWorkload(RuleBasedStateMachine):
    """Requests over shared prefixes on small tiers (GPU, CPU and a disk tier or
    none), random task outcomes, lost disk blocks, generation moves and clears.

    After every step: every block has exactly one owner on every tier, and every
    block a live request holds still contains that request's data; every block a
    match serves holds the data written for its key.
    """

    @initialize(
        gpu=st.integers(3, 10), cpu=st.integers(0, 8), disk=st.sampled_from([0, 2, 4, 6, 8, 12]), gens=GEN_MODES
    )
    def start(self, gpu: int, cpu: int, disk: int, gens: str) -> None:
        self.bus = FakeBus()
        self.gens = gens
        if gens != "none":
            self.bus.gen, self.bus.cpu_gen = 0, (0 if gens == "both" else None)
        self.manager = PrefixCacheManager(self.bus, BS, gpu, cpu, swap_timeout=0.01, num_disk_blocks=disk)
        # (tokens, the match's lease, the allocated lease, the bus's gen they were computed at)
        self.running: list[tuple[list[int], BlockLease, BlockLease, int | None]] = []
        self.seen: list[list[int]] = []
        self.steps_since_clear = 0

    def script(self, outcomes: list[str]) -> None:
        """A bus that names no generation cannot move one."""
        self.bus.script(*(o.partition("+")[0] if self.gens == "none" else o for o in outcomes))

    def run_request(
        self, tokens: list[int], outcomes: list[str], use_cache: bool = True, late_copies_land: bool = False
    ) -> None:
        self.steps_since_clear += 1
        if len(self.running) >= 2:  # bounded concurrency, like a scheduler's batch
            self.finish_request(0)
        self.script(outcomes)
        gen = self.bus.gen
        cached = self.manager.match(tokens if use_cache else [])
        if self.manager.cleared:
            assert cached.num_blocks == 0
            with pytest.raises(CacheClearedError):
                self.manager.allocate(1)
            return
        keys = block_keys(tokens, BS)
        assert [self.bus.gpu.get(b) for b in cached.block_ids] == [kv_of(k) for k in keys[: cached.num_blocks]]
        try:
            fresh = self.manager.allocate(-(-len(tokens) // BS) - cached.num_blocks)
        except OutOfGpuBlocksError:
            self.manager.release(cached)
            return
        for position, block in enumerate(fresh.block_ids, start=cached.num_blocks):
            self.bus.gpu[block] = kv_of(keys[position]) if position < len(keys) else ("partial",)
        self.manager.insert(tokens, cached.block_ids + fresh.block_ids[: len(keys) - cached.num_blocks])
        # A generation move meanwhile (a task's "+gen") took what the match served: not checked later.
        self.running.append((tokens, cached, fresh, gen if self.bus.gen == gen else -1))
        self.seen.append(tokens)
        if late_copies_land:  # timed-out copies landing now would clobber any block reused too early
            self.bus.deliver_late()

    @rule(
        prompts=st.lists(
            st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 3), st.integers(0, 9)),
            min_size=1,
            max_size=3,
        ),
        outcomes=SWAP_OUTCOMES,
        use_cache=st.booleans(),
        late=st.booleans(),
    )
    def request(
        self, prompts: list[tuple[int, int, int, int]], outcomes: list[str], use_cache: bool, late: bool
    ) -> None:
        """Prompts sharing prefixes with others (family, shared blocks, variant, extra tokens);
        without the cache they may duplicate cached blocks."""
        for family, shared, variant, extra in prompts:
            tokens = prompt(family, shared) + [50_000 + family * 100 + variant * 10 + i for i in range(extra)]
            self.run_request(tokens, outcomes, use_cache, late)
            outcomes = []

    @rule(first=st.integers(10, 40), beyond=st.integers(0, 6), blocks=st.integers(1, 4), outcomes=SWAP_OUTCOMES)
    def burst(self, first: int, beyond: int, blocks: int, outcomes: list[str]) -> None:
        """Prompts of their own, one after the other, more than the GPU and the CPU
        hold: older blocks go down the tiers (to the disk, if there is one)."""
        stats = self.manager.stats()
        count = (stats["gpu"]["total"] + stats["cpu"]["total"] + beyond) // blocks + 1
        for family in range(first, first + count):
            self.run_request(prompt(family, blocks), outcomes)
            outcomes = []

    @precondition(lambda self: self.seen)
    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=3), outcomes=SWAP_OUTCOMES, late=st.booleans())
    def repeat_request(self, picks: list[int], outcomes: list[str], late: bool) -> None:
        """Earlier prompts again: their blocks may sit on the CPU or the disk by now."""
        for pick in picks:
            self.run_request(self.seen[pick % len(self.seen)], outcomes, late_copies_land=late)
            outcomes = []

    @precondition(lambda self: self.bus.disk)
    @rule(pick=st.integers(0, 100), outcomes=SWAP_OUTCOMES)
    def revisit_the_disk(self, pick: int, outcomes: list[str]) -> None:
        """An earlier prompt whose blocks reach the disk: the match loads them (or must not serve them)."""
        on_disk = [tokens for tokens in self.seen[-40:] if "disk" in self.manager.locate(tokens)]
        if on_disk:
            self.run_request(on_disk[pick % len(on_disk)], outcomes)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick: int) -> None:
        self.finish_request(pick)

    def finish_request(self, pick: int) -> None:
        _, cached, fresh, _ = self.running.pop(pick % len(self.running))
        self.manager.release(cached)
        self.manager.release(fresh)

    @rule(count=st.integers(1, 6), outcomes=SWAP_OUTCOMES)
    def evict(self, count: int, outcomes: list[str]) -> None:
        self.script(outcomes)
        self.manager.evict(count)

    @precondition(lambda self: self.bus.ops("spill"))
    @rule(pick=st.integers(0, 100))
    def a_disk_block_goes_bad(self, pick: int) -> None:
        """Its digest will not check (one the last spill wrote, likely still cached): a load of it
        fails, and it must never be served."""
        blocks = self.bus.ops("spill")[-1].dst
        self.bus.lose_disk(blocks[pick % len(blocks)])

    @precondition(lambda self: self.gens != "none")
    @rule(cpu_too=st.booleans())
    def a_rank_restarts(self, cpu_too: bool) -> None:
        """With its CPU tier (gen moves alone) or without (cpu_gen moves too)."""
        if cpu_too:
            self.bus.move_cpu_gen()
        else:
            self.bus.move_gen()

    @rule()
    def slow_ranks_finish(self) -> None:
        self.bus.deliver_late()

    @rule()
    def pause_drains_the_bus(self) -> None:
        self.bus.deliver_late()  # a pause is acked only once every rank finished its tasks
        self.manager.on_bus_drained()

    @precondition(lambda self: not self.manager.cleared and self.steps_since_clear >= 8)
    @rule()
    def clear(self) -> None:
        self.bus.clear()
        self.manager.set_cleared()
        self.steps_since_clear = 0

    @precondition(lambda self: self.manager.cleared)
    @rule(gpu=st.integers(3, 10), cpu=st.integers(0, 8), disk=st.sampled_from([0, 2, 4, 6, 8, 12]))
    def resume(self, gpu: int, cpu: int, disk: int) -> None:
        self.manager.resume(gpu, cpu, num_disk_blocks=disk)

    @invariant()
    def every_block_has_one_owner(self) -> None:
        self.manager.check_invariants()
        stats = self.manager.stats()
        for tier in ("gpu", "cpu", "disk"):
            usage = stats[tier]
            assert usage["free"] + usage["used"] == usage["total"]

    @invariant()
    def running_requests_still_see_their_data(self) -> None:
        for tokens, cached, fresh, gen in self.running:
            if cached.epoch != self.manager.epoch or gen != self.bus.gen:
                continue  # from before a clear or a generation move: its blocks are gone
            keys = block_keys(tokens, BS)
            held = cached.block_ids + fresh.block_ids[: len(keys) - cached.num_blocks]
            assert [self.bus.gpu.get(b) for b in held] == [kv_of(k) for k in keys[: len(held)]]


RandomWorkload.TestCase.settings = settings(
    max_examples=1000 if LONG else 100, stateful_step_count=100 if LONG else 50, deadline=None
)
test_random_workload = pytest.mark.timeout(1800 if LONG else 120)(RandomWorkload.TestCase)


def test_serves_hits_after_a_clear_in_the_middle_of_a_workload():
    engine = Engine(gpu=6, cpu=4)
    tokens = prompt(1, 3)
    held = engine.serve(tokens)
    engine.bus.script("timeout")
    engine.manager.evict(6)
    engine.bus.clear()
    engine.manager.set_cleared()
    engine.manager.resume(6, 4)
    for lease in held:
        engine.manager.release(lease)
    engine.manager.check_invariants()
    engine.serve_and_finish(tokens)
    assert engine.manager.match(tokens).gpu_hit_blocks == 3


def test_insert_with_the_keys_of_a_match_hashes_only_the_tail_and_gives_the_same_tree():
    from zkv.prefix import PrefixCacheManager
    from zkv.testing.fakebus import FakeBus

    tokens = list(range(64))
    results = []
    for reuse in (False, True):
        m = PrefixCacheManager(FakeBus(), block_size=8, num_gpu_blocks=16, num_cpu_blocks=16)
        first = m.allocate(4)
        m.insert(tokens[:32], first.block_ids)
        cached = m.match(tokens[:40])  # 5 full blocks asked, 4 cached
        assert len(cached.keys) == 5 and cached.num_blocks == 4
        fresh = m.allocate(4)
        ids = cached.block_ids + fresh.block_ids
        m.insert(tokens, ids, known_keys=cached.keys if reuse else ())
        m.release(first), m.release(cached), m.release(fresh)
        m.check_invariants()
        results.append((m.locate(tokens), m.match(tokens).block_ids))
    assert results[0] == results[1] and results[0][0] == ["gpu"] * 8
