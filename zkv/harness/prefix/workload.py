"""A synthetic chat workload served through a PrefixCacheManager over the real bus.

Requests are multi-turn chats: a few system prompts shared by everyone, and
conversations picked with Zipf-skewed popularity, each request repeating the
conversation so far plus a new turn (so every turn's blocks are reused by the
next).  Popular conversations stay on the GPU; cold ones are swapped out to
the CPU and, when they come back, swapped in again; the coldest are spilled
to the disk tier (when the manager has one) and loaded back, or dropped.

Serving a request is what an engine's scheduler does with the manager:
``match`` the prompt, ``allocate`` blocks for the rest, "compute" them (here:
a ``fill`` task writes deterministic random bits into those GPU blocks on
every rank), ``insert`` the full blocks, ``release`` the leases.

With ``verify`` every block the cache hands out is checked bit for bit: when
a block is computed its per-rank digests are taken (``checksum`` task) and
kept under the block's key; every later hit (on the GPU, swapped back in
from the CPU, or loaded back from the disk) must have the same digests on
every rank.  Any mismatch, a task
that is not ``ok``, or a broken manager invariant is an error.
"""

from __future__ import annotations

import bisect
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...cycle.prefix import pause_clear_resume
from ...prefix.manager import OutOfGpuBlocksError, PrefixCacheManager
from ...prefix.radix import block_keys
from ...wire.moves import TIER_ORDER
from ...wire.vocab import Op, Tier


@dataclass(frozen=True)
class ChatSpec:
    """Shape of the synthetic workload, in tokens and blocks."""

    system_prompts: int = 4
    system_blocks: int = 8  # each system prompt, in full blocks
    conversations: int = 24
    zipf_s: float = 0.6  # popularity skew of conversations (and of system prompts)
    turn_tokens: tuple[int, int] = (48, 128)
    max_blocks: int = 64  # a conversation longer than this starts over

    @classmethod
    def for_cache(cls, gpu_blocks: int) -> "ChatSpec":
        """A spec that puts a GPU of ``gpu_blocks`` (of 16 tokens) under pressure: the
        conversations in play hold a few times more KV than the GPU, more than the CPU
        of twice that size.  The defaults are for 256 blocks."""
        if gpu_blocks >= 256:
            return cls()
        return cls(
            system_prompts=2,
            system_blocks=max(1, gpu_blocks // 32),
            conversations=8,
            turn_tokens=(8, 40),
            max_blocks=max(3, gpu_blocks // 5),
        )

    @classmethod
    def for_tiers(cls, gpu_blocks: int, cpu_blocks: int, block_size: int = 16) -> "ChatSpec":
        """A spec whose conversations outgrow the GPU and the CPU together within
        about a hundred requests: evenly popular, long turns, so a conversation's
        history is pushed below the CPU before it comes back (to the disk tier,
        if there is one, else it is dropped and computed again).  For 256 + 512
        blocks: 24 conversations of turns of 8-20 blocks."""
        capacity = gpu_blocks + cpu_blocks
        turn = max(4, capacity // 96) * block_size
        return cls(
            system_prompts=4,
            system_blocks=max(1, capacity // 96),
            conversations=24,
            zipf_s=0.0,
            turn_tokens=(turn, turn * 5 // 2),
            max_blocks=max(4, capacity // 8),
        )


class ChatWorkload:
    """Generates request token lists (deterministic per seed)."""

    def __init__(self, block_size: int, spec: ChatSpec | None = None, seed: int = 0) -> None:
        self.spec = spec or ChatSpec()
        self.block_size = block_size
        self._rng = random.Random(seed)
        self._fresh = itertools.count(1)
        spec = self.spec
        self._systems = [self._tokens(spec.system_blocks * block_size) for _ in range(spec.system_prompts)]
        self._sys_weights = _zipf_cum(spec.system_prompts, spec.zipf_s)
        self._conv_weights = _zipf_cum(spec.conversations, spec.zipf_s)
        self._histories: list[list[int]] = [self._start() for _ in range(spec.conversations)]

    def _tokens(self, n: int) -> list[int]:
        # Distinct per call (the counter) and random-looking (the rng): never an accidental prefix match.
        base = next(self._fresh) << 16
        return [base + self._rng.randrange(1 << 16) for _ in range(n)]

    def _start(self) -> list[int]:
        pick = bisect.bisect(self._sys_weights, self._rng.random() * self._sys_weights[-1])
        return list(self._systems[min(pick, len(self._systems) - 1)])

    def next_request(self) -> list[int]:
        spec = self.spec
        conv = bisect.bisect(self._conv_weights, self._rng.random() * self._conv_weights[-1])
        conv = min(conv, spec.conversations - 1)
        turn = self._tokens(self._rng.randint(*spec.turn_tokens))
        history = self._histories[conv]
        if (len(history) + len(turn)) // self.block_size > spec.max_blocks:
            history = self._histories[conv] = self._start()
        tokens = history + turn
        self._histories[conv] = tokens  # the next turn repeats this request
        return tokens


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (rank + 1) ** s for rank in range(n)))


@dataclass
class WorkloadReport:
    requests: int = 0
    served: int = 0
    out_of_blocks: int = 0  # requests refused: too few GPU blocks even after eviction
    elapsed_s: float = 0.0
    prompt_blocks: int = 0
    verified_hit_blocks: int = 0  # cache hits checked bit for bit on every rank
    compute_tasks: int = 0  # fill tasks (the stand-in for the engine's forward pass)
    checksum_tasks: int = 0
    cycles: list[dict[str, Any]] = field(default_factory=list)
    before_cycle: dict[str, int] = field(default_factory=dict)  # hit counters just before the last cycle
    errors: list[str] = field(default_factory=list)
    manager: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def computed_blocks(self) -> int:
        """Prompt blocks the cache had on no tier (the engine computes them)."""
        st = self.manager
        return st.get("queried_blocks", 0) - sum(st.get(f"{t}_hit_blocks", 0) for t in TIER_ORDER)

    def hit_rates_since_cycle(self) -> tuple[float, float]:
        """GPU and CPU hit rates over the requests after the last cycle."""
        if not self.before_cycle or not self.manager:
            return 0.0, 0.0
        queried = self.manager["queried_blocks"] - self.before_cycle["queried_blocks"]
        if not queried:
            return 0.0, 0.0
        return (
            (self.manager["gpu_hit_blocks"] - self.before_cycle["gpu_hit_blocks"]) / queried,
            (self.manager["cpu_hit_blocks"] - self.before_cycle["cpu_hit_blocks"]) / queried,
        )

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0

    def summary(self) -> dict[str, Any]:
        stats = self.manager
        swaps = stats.get("swaps", {})
        return {
            "requests": self.requests,
            "served": self.served,
            "out_of_blocks": self.out_of_blocks,
            "elapsed_s": self.elapsed_s,
            "requests_per_s": self.requests_per_s,
            "gpu_hit_rate": stats.get("gpu_hit_rate", 0.0),
            "cpu_hit_rate": stats.get("cpu_hit_rate", 0.0),
            "disk_hit_rate": stats.get("disk_hit_rate", 0.0),
            "computed_blocks": self.computed_blocks(),
            "dropped": {t: stats.get(f"dropped_{t}_blocks", 0) for t in TIER_ORDER},
            "swaps": swaps,
            "bytes_moved": sum(op.get("bytes", 0) for op in swaps.values()),
            "verified_hit_blocks": self.verified_hit_blocks,
            "cycles": len(self.cycles),
            "errors": list(self.errors),
        }


class _Verifier:
    """Per-rank digests of every block the cache holds, by block key."""

    def __init__(self) -> None:
        self.digests: dict[bytes, tuple[bytes, ...]] = {}

    @staticmethod
    def per_block(outcome: Any) -> list[tuple[bytes, ...]]:
        ranks = sorted(outcome.per_rank)
        columns = [outcome.per_rank[rank]["digests"] for rank in ranks]
        return [tuple(bytes(d) for d in row) for row in zip(*columns)]


def serve_workload(
    client: Any,
    manager: PrefixCacheManager,
    requests: int,
    *,
    workload: ChatWorkload | None = None,
    verify: bool = True,
    cycle_at: int | None = None,
    cycle_layout: dict | None = None,
    cycle_update: Callable[[], Any] | None = None,
    check_every: int = 10,
    task_timeout: float = 30.0,
    on_request: Callable[[int], None] | None = None,
) -> WorkloadReport:
    """Serve ``requests`` requests through ``manager`` with ``client`` (a ``zkv.client.Client``).

    ``cycle_at``: run a pause / clear / resume cycle before that request (the
    RL trainer's weight update), optionally resuming with ``cycle_layout``;
    ``cycle_update()`` runs between its clear and its resume (an engine that
    owns the ranks' memory reallocates there).
    Never raises for a bad task or a mismatch: they land in ``report.errors``.
    """
    workload = workload or ChatWorkload(manager.block_size)
    report = WorkloadReport()
    verifier = _Verifier()
    start = time.perf_counter()
    for number in range(requests):
        if cycle_at is not None and number == cycle_at:
            stats = manager.stats()
            report.before_cycle = {k: stats[k] for k in ("queried_blocks", "gpu_hit_blocks", "cpu_hit_blocks")}
            try:
                info = pause_clear_resume(client, manager, cycle_layout, update=cycle_update)
            except Exception as err:  # noqa: BLE001 - reported, the run goes on
                report.errors.append(f"pause/clear/resume failed: {err}")
            else:
                report.cycles.append(info)
            verifier.digests.clear()  # the caches were freed: nothing cached survives
        report.requests += 1
        error = _serve_one(client, manager, workload.next_request(), number, verify, verifier, report, task_timeout)
        if error:
            report.errors.append(f"request {number}: {error}")
        if check_every and number % check_every == check_every - 1:
            error = _check_manager(manager)
            if error:
                report.errors.append(f"after request {number}: {error}")
        if on_request is not None:
            on_request(number)
        if len(report.errors) > 20:
            report.errors.append("too many errors; stopped")
            break
    report.elapsed_s = time.perf_counter() - start
    error = _check_manager(manager)
    if error:
        report.errors.append(f"at the end: {error}")
    report.manager = manager.stats()
    return report


def _check_manager(manager: PrefixCacheManager) -> str | None:
    try:
        manager.check_invariants()
    except AssertionError as err:
        return f"manager invariant broken: {err}"
    stats = manager.stats()
    for tier in TIER_ORDER:
        usage = stats[tier]
        if usage["free"] + usage["used"] != usage["total"]:
            return f"{tier}: free {usage['free']} + used {usage['used']} != total {usage['total']}"
    return None


def _serve_one(
    client: Any,
    manager: PrefixCacheManager,
    tokens: list[int],
    number: int,
    verify: bool,
    verifier: _Verifier,
    report: WorkloadReport,
    task_timeout: float,
) -> str | None:
    bs = manager.block_size
    total_blocks = -(-len(tokens) // bs)
    cached = manager.match(tokens[:-1])  # the last token is always computed, for its logits
    try:
        fresh = manager.allocate(total_blocks - cached.num_blocks)
    except OutOfGpuBlocksError:
        manager.release(cached)
        report.out_of_blocks += 1
        return None
    try:
        keys = block_keys(tokens, bs)
        report.prompt_blocks += len(keys)
        full_fresh = fresh.block_ids[: len(keys) - cached.num_blocks]
        if fresh.block_ids:
            report.compute_tasks += 1
            out = client.run(Op.FILL, None, fresh.block_ids, timeout=task_timeout, tier=Tier.GPU, seed=number + 1)
            if not out.ok:
                return f"fill of {fresh.num_blocks} blocks ended {out.outcome}: {out.reason}"
        if verify and (cached.block_ids or full_fresh):
            report.checksum_tasks += 1
            out = client.run(Op.CHECKSUM, cached.block_ids + full_fresh, timeout=task_timeout, tier=Tier.GPU)
            if not out.ok:
                return f"checksum ended {out.outcome}: {out.reason}"
            rows = verifier.per_block(out)
            for position in range(cached.num_blocks):
                want = verifier.digests.get(keys[position])
                if want is None:
                    return f"hit on block {position} whose contents were never computed"
                if rows[position] != want:
                    where = (
                        "on the GPU"
                        if position < cached.gpu_hit_blocks
                        else "swapped back from the CPU"
                        if position < cached.gpu_hit_blocks + cached.cpu_hit_blocks
                        else "loaded back from the disk"
                    )
                    return (
                        f"block {position} ({where}, gpu block {cached.block_ids[position]}) "
                        "differs from what was computed into it"
                    )
            report.verified_hit_blocks += cached.num_blocks
            before = manager.locate(tokens[: len(keys) * bs])
            for offset in range(len(full_fresh)):
                position = cached.num_blocks + offset
                if position < len(before) and before[position] == Tier.GPU:
                    continue  # cached elsewhere already: the tree keeps that block (a duplicate)
                verifier.digests[keys[position]] = rows[position]
        manager.insert(tokens, cached.block_ids + full_fresh, known_keys=cached.keys)
        report.served += 1
        return None
    finally:
        manager.release(cached)
        manager.release(fresh)
