"""The ``zkv up --demo`` workload: real swaps on every rank, checked bit for bit."""

from __future__ import annotations

import random
import time
from typing import Callable

from .client import Client
from .layout import CacheLayout


def run_demo(broker: str, layout: CacheLayout, requests: int, echo: Callable[[str], None] = print) -> bool:
    """Fill, swap out, scribble, swap in, and compare digests; then a burst of swaps."""
    n = min(32, layout.gpu_blocks, layout.cpu_blocks)
    rng = random.Random(7)
    gpu_ids = rng.sample(range(layout.gpu_blocks), n)
    cpu_ids = rng.sample(range(layout.cpu_blocks), n)
    with Client(broker) as c:
        steps = [c.run("fill", None, gpu_ids, tier="gpu", seed=1)]
        before = c.run("checksum", gpu_ids, tier="gpu")
        steps += [c.run("swap_out", gpu_ids, cpu_ids), c.run("fill", None, gpu_ids, tier="gpu", seed=2),
                  c.run("swap_in", cpu_ids, gpu_ids)]
        after = c.run("checksum", gpu_ids, tier="gpu")
        same = all(before.per_rank[r]["digests"] == after.per_rank[r]["digests"] for r in before.per_rank)
        echo(f"round trip of {n} blocks on {len(before.per_rank)} ranks: {'bit-identical' if same else 'MISMATCH'}")
        ok = same and all(s.ok for s in steps)
        start = time.perf_counter()
        outcomes = {}
        moved = 0
        tasks = []
        for i in range(requests):
            k = rng.randint(1, min(16, n))
            src = rng.sample(range(layout.gpu_blocks), k)
            dst = rng.sample(range(layout.cpu_blocks), k)
            tasks.append(c.submit("swap_out" if i % 2 == 0 else "swap_in", src if i % 2 == 0 else dst, dst if i % 2 == 0 else src))
        for t in tasks:
            out = c.wait(t)
            outcomes[out.outcome] = outcomes.get(out.outcome, 0) + 1
            moved += out.bytes
        elapsed = time.perf_counter() - start
        echo(f"{requests} swap tasks: {outcomes} in {elapsed:.2f} s ({requests / elapsed:.0f} tasks/s, {moved / elapsed / 2**20:.0f} MiB/s across ranks)")
        return ok and outcomes.get("ok", 0) == requests
