"""Micro-benchmark of the prefix cache manager's bookkeeping, bus excluded.

Requests share a few system prompts and then diverge; every ``revisit_every``-th
request repeats an older one whose blocks were meanwhile swapped out to the CPU
(the GPU holds ``gpu_requests`` prompts), so they are swapped back in.  The figure
covers hashing, tree walks, leases, eviction and swap bookkeeping.  The fake
bus copies dict entries, so transfer time is not part of it.
"""

from __future__ import annotations

import time

from .fakebus import FakeBus
from .manager import PrefixCacheManager


def bench_manager(n_requests: int = 500, prompt_tokens: int = 4096, block_size: int = 64,
                  shared_prompts: int = 4, shared_fraction: float = 0.5,
                  gpu_requests: int = 4, cpu_requests: int = 16, revisit_every: int = 4) -> dict[str, object]:
    """µs per request of match + allocate + insert + release, plus the cache's stats.

    ``gpu_requests`` / ``cpu_requests`` size the tiers in whole prompts.
    """
    blocks_per_prompt = -(-prompt_tokens // block_size)
    bus = FakeBus()
    manager = PrefixCacheManager(bus, block_size, num_gpu_blocks=gpu_requests * blocks_per_prompt,
                                 num_cpu_blocks=cpu_requests * blocks_per_prompt)
    shared_len = int(prompt_tokens * shared_fraction)
    prefixes = [list(range(p * 1_000_000, p * 1_000_000 + shared_len)) for p in range(shared_prompts)]
    unique_len = prompt_tokens - shared_len
    elapsed_ns = 0
    originals: list[int] = []
    for request in range(n_requests):
        source = request
        if revisit_every and request % revisit_every == revisit_every - 1 and len(originals) > 2 * gpu_requests:
            source = originals[-2 * gpu_requests]
        else:
            originals.append(request)
        base = 100_000_000 + source * unique_len
        tokens = prefixes[source % shared_prompts] + list(range(base, base + unique_len))
        start = time.perf_counter_ns()
        cached = manager.match(tokens[:-1])  # the last token is always computed
        fresh = manager.allocate(blocks_per_prompt - cached.num_blocks)
        full = len(tokens) // block_size
        manager.insert(tokens, cached.block_ids + fresh.block_ids[: full - cached.num_blocks])
        manager.release(cached)
        manager.release(fresh)
        elapsed_ns += time.perf_counter_ns() - start
    stats = manager.stats()
    return {
        "requests": n_requests,
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "us_per_request": elapsed_ns / n_requests / 1000,
        "gpu_hit_rate": stats["gpu_hit_rate"],
        "cpu_hit_rate": stats["cpu_hit_rate"],
        "swaps": stats["swaps"],
    }


if __name__ == "__main__":
    print(bench_manager())
