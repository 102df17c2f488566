"""Benchmarks of the prefix cache manager, each beside a same-run baseline.

``bench_manager``: the manager's bookkeeping per request, bus excluded: the
in-process fake bus copies dict entries (so no transfer time), and the time
spent inside its calls is timed and taken out (``fake_bus_us``, reported
beside; ``us_per_request_with_bus`` counts it).
Requests share a few system prompts and then diverge; every
``revisit_every``-th request repeats an older one whose blocks were meanwhile
swapped out to the CPU (the GPU holds ``gpu_requests`` prompts), so they are
swapped back in.  The figure covers hashing, tree walks, leases, eviction and
swap bookkeeping.  Baselines, timed on the same prompts in the same loop:
computing the block keys alone (``block_keys``, the hashing any prefix cache
does), and a flat dict keyed by block key (look every key up, store the
missing ones): a cache with no tiers, leases or eviction.

``bench_manager_cluster``: the chat workload (``zkv.harness.prefix.workload``) served
through the manager on a real local cluster (broker + ranks as processes):
requests/s, hit rates, swaps.  Baseline: the same request stream on the same
cluster without a prefix cache (one ``fill`` task writes every block of every
prompt, as if recomputed; no match, no swap).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ...prefix.manager import PrefixCacheManager
from ...prefix.radix import block_keys
from ...testing.fakebus import FakeBus


class _TimedBus(FakeBus):
    """The fake bus, counting the nanoseconds spent inside its calls (not the manager's)."""

    def __init__(self) -> None:
        super().__init__()
        self.spent_ns = 0

    def submit(self, *args: Any, **kwargs: Any) -> int:
        return self._timed(super().submit, *args, **kwargs)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().wait, *args, **kwargs)

    def _timed(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            self.spent_ns += time.perf_counter_ns() - start


def bench_manager(
    n_requests: int = 500,
    prompt_tokens: int = 4096,
    block_size: int = 64,
    shared_prompts: int = 4,
    shared_fraction: float = 0.5,
    gpu_requests: int = 4,
    cpu_requests: int = 16,
    revisit_every: int = 4,
) -> dict[str, object]:
    """µs per request of match + allocate + insert + release (the fake bus's calls taken out),
    plus the cache's stats and baselines.

    ``gpu_requests`` / ``cpu_requests`` size the tiers in whole prompts.
    """
    blocks_per_prompt = -(-prompt_tokens // block_size)
    bus = _TimedBus()
    manager = PrefixCacheManager(
        bus,
        block_size,
        num_gpu_blocks=gpu_requests * blocks_per_prompt,
        num_cpu_blocks=cpu_requests * blocks_per_prompt,
    )
    shared_len = int(prompt_tokens * shared_fraction)
    prefixes = [list(range(p * 1_000_000, p * 1_000_000 + shared_len)) for p in range(shared_prompts)]
    unique_len = prompt_tokens - shared_len
    elapsed_ns = keys_ns = dict_ns = 0
    flat: dict[bytes, int] = {}
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
        block_keys(tokens[:-1], block_size)
        keys_ns += time.perf_counter_ns() - start

        start = time.perf_counter_ns()
        for key in block_keys(tokens[:-1], block_size):
            if flat.get(key) is None:
                flat[key] = len(flat)
        dict_ns += time.perf_counter_ns() - start

        start = time.perf_counter_ns()
        cached = manager.match(tokens[:-1])  # the last token is always computed
        fresh = manager.allocate(blocks_per_prompt - cached.num_blocks)
        full = len(tokens) // block_size
        manager.insert(tokens, cached.block_ids + fresh.block_ids[: full - cached.num_blocks], known_keys=cached.keys)
        manager.release(cached)
        manager.release(fresh)
        elapsed_ns += time.perf_counter_ns() - start
    stats = manager.stats()
    return {
        "requests": n_requests,
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "us_per_request": (elapsed_ns - bus.spent_ns) / n_requests / 1000,
        "us_per_request_with_bus": elapsed_ns / n_requests / 1000,
        "fake_bus_us": bus.spent_ns / n_requests / 1000,
        "baseline_block_keys_us": keys_ns / n_requests / 1000,
        "baseline_dict_cache_us": dict_ns / n_requests / 1000,
        "gpu_hit_rate": stats["gpu_hit_rate"],
        "cpu_hit_rate": stats["cpu_hit_rate"],
        "swaps": stats["swaps"],
    }


def bench_manager_cluster(requests: int = 200, layout: Any = None, ranks: int = 2, seed: int = 1) -> dict[str, Any]:
    """The chat workload through the manager on a real LocalCluster, and without a cache."""
    from ...wire.layout import CacheLayout
    from ..bus.cluster import LocalCluster
    from .workload import ChatSpec, ChatWorkload, serve_workload

    layout = layout or CacheLayout()
    spec = ChatSpec.for_cache(layout.gpu_blocks)
    with LocalCluster(ranks, layout, quiet=True) as cluster, cluster.client() as client:
        # Warm up connections and the ranks' copy paths (not measured).
        serve_workload(
            client,
            PrefixCacheManager(client, layout.block_size, layout.gpu_blocks, layout.cpu_blocks),
            20,
            workload=ChatWorkload(layout.block_size, spec, seed=seed + 1000),
            verify=False,
        )

        prompts = ChatWorkload(layout.block_size, spec, seed=seed)
        stream = [prompts.next_request() for _ in range(requests)]
        start = time.perf_counter()
        for number, tokens in enumerate(stream):
            blocks = min(-(-len(tokens) // layout.block_size), layout.gpu_blocks)
            out = client.run("fill", None, list(range(blocks)), tier="gpu", seed=number + 1)
            if not out.ok:
                raise RuntimeError(f"baseline fill ended {out.outcome}: {out.reason}")
        no_cache_s = time.perf_counter() - start

        manager = PrefixCacheManager(client, layout.block_size, layout.gpu_blocks, layout.cpu_blocks)
        report = serve_workload(
            client, manager, requests, workload=ChatWorkload(layout.block_size, spec, seed=seed), verify=False
        )
        if not report.ok:
            raise RuntimeError(f"workload errors: {report.errors[:3]}")
    summary = report.summary()
    return {
        "requests": requests,
        "ranks": ranks,
        "requests_per_s": summary["requests_per_s"],
        "gpu_hit_rate": summary["gpu_hit_rate"],
        "cpu_hit_rate": summary["cpu_hit_rate"],
        "swaps": {op: {k: v for k, v in counts.items() if v} for op, counts in summary["swaps"].items()},
        "bytes_moved": summary["bytes_moved"],
        "baseline_no_cache_requests_per_s": requests / no_cache_s if no_cache_s else 0.0,
        "prompt_blocks": report.prompt_blocks,
    }


if __name__ == "__main__":
    print(bench_manager())
    print(bench_manager_cluster())
