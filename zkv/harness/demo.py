"""The ``zkv up --demo`` workload: real swaps on every rank, checked bit for bit.

1. A round trip: fill blocks, swap them out, scribble over them, swap them
   back in, and compare per-rank digests.
2. A chat workload served through the prefix cache manager
   (``zkv.harness.workload``): shared system prompts, Zipf-popular multi-turn
   conversations, more KV than the GPU holds, so cold prefixes are swapped
   out to the CPU and back in when they return.  Every cache hit is checked
   bit for bit on every rank, and halfway through the workload an RL-style
   pause / clear / resume cycle runs (``zkv.prefix.cycle``).
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

from ..client.client import Client
from ..prefix import PrefixCacheManager
from ..wire.layout import CacheLayout
from .workload import ChatSpec, ChatWorkload, serve_workload


def round_trip(c: Client, layout: CacheLayout, echo: Callable[[str], None]) -> bool:
    n = min(32, layout.gpu_blocks, layout.cpu_blocks)
    rng = random.Random(7)
    gpu_ids = rng.sample(range(layout.gpu_blocks), n)
    cpu_ids = rng.sample(range(layout.cpu_blocks), n)
    steps = [c.run("fill", None, gpu_ids, tier="gpu", seed=1)]
    before = c.run("checksum", gpu_ids, tier="gpu")
    steps += [
        c.run("swap_out", gpu_ids, cpu_ids),
        c.run("fill", None, gpu_ids, tier="gpu", seed=2),
        c.run("swap_in", cpu_ids, gpu_ids),
    ]
    after = c.run("checksum", gpu_ids, tier="gpu")
    same = (
        before.ok
        and after.ok
        and all(before.per_rank[r]["digests"] == after.per_rank[r]["digests"] for r in before.per_rank)
    )
    echo(f"round trip of {n} blocks on {len(before.per_rank)} ranks: {'bit-identical' if same else 'MISMATCH'}")
    bad = [s for s in steps if not s.ok]
    for s in bad:
        echo(f"  task {s.task} ended {s.outcome}: {s.reason}")
    return same and not bad


class Progress:
    """A line every ``every`` seconds while the workload runs, so a demo of
    tens of seconds never looks hung (``serve_workload``'s ``on_request``)."""

    def __init__(self, total: int, echo: Callable[[str], None], every: float = 3.0, clock: Any = time.monotonic):
        self.total, self.echo, self.every, self.clock = total, echo, every, clock
        self.start = clock()
        self.next = self.start + every

    def __call__(self, number: int) -> None:
        now = self.clock()
        if now >= self.next and number + 1 < self.total:
            self.next = now + self.every
            self.echo(f"  ... {number + 1}/{self.total} requests served ({now - self.start:.0f} s)")


def _mib(n: float) -> str:
    return f"{n / 2**10:.0f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def run_demo(
    broker: str,
    layout: CacheLayout,
    requests: int,
    echo: Callable[[str], None] = print,
    update: Callable[[], Any] | None = None,
    progress_every: float = 3.0,
) -> bool:
    """Round trip, then ``requests`` chat requests through the prefix cache manager.

    ``update``: runs between the cycle's clear and its resume (with ``--attach``
    the engines reallocate their caches there); a progress line every
    ``progress_every`` seconds."""
    with Client(broker) as c:
        ok = round_trip(c, layout, echo)
        spec = ChatSpec.for_cache(layout.gpu_blocks)
        manager = PrefixCacheManager(c, layout.block_size, layout.gpu_blocks, layout.cpu_blocks, swap_timeout=10.0)
        workload = ChatWorkload(layout.block_size, spec, seed=1)
        echo(
            f"prefix cache: {requests} chat requests, {spec.system_prompts} system prompts x "
            f"{spec.conversations} Zipf-popular conversations, on {layout.gpu_blocks} GPU + "
            f"{layout.cpu_blocks} CPU blocks of {layout.block_size} tokens "
            f"({_mib(layout.block_bytes)} per block per rank); pause/clear/resume at request {requests // 2}"
        )
        t0 = time.perf_counter()
        report = serve_workload(
            c,
            manager,
            requests,
            workload=workload,
            verify=True,
            cycle_at=requests // 2 if requests >= 2 else None,
            cycle_update=update,
            on_request=Progress(requests, echo, progress_every),
        )
        wall = time.perf_counter() - t0
        s = report.summary()
        st = report.manager
        echo(
            f"  served {report.served}/{report.requests} requests in {wall:.2f} s: "
            f"{s['requests_per_s']:.0f} requests/s ({report.compute_tasks} compute + "
            f"{report.checksum_tasks} checksum tasks besides the swaps)"
        )
        echo(
            f"  hit rate over {st['queried_blocks']} prompt blocks: GPU {s['gpu_hit_rate']:.1%}, "
            f"CPU {s['cpu_hit_rate']:.1%} (swapped back in), miss {1 - s['gpu_hit_rate'] - s['cpu_hit_rate']:.1%}"
        )
        for op in ("swap_out", "swap_in"):
            sw = s["swaps"][op]
            outcomes = {k: sw[k] for k in ("ok", "failed", "cancelled", "rejected", "timeout") if sw[k]}
            echo(
                f"  {op}: {sw['issued']} tasks, {sw['blocks']} blocks, {_mib(sw['bytes'])} across ranks,"
                f" outcomes {outcomes or '{}'}"
            )
        echo(
            f"  bytes moved by swaps: {_mib(s['bytes_moved'])}; dropped when the CPU was full: "
            f"{st['dropped_cpu_blocks']} CPU blocks, {st['dropped_gpu_blocks']} GPU blocks"
        )
        for cycle in report.cycles:
            echo(
                f"  pause/clear/resume: drain {cycle['pause'].get('drain_ms', 0):.1f} ms, "
                f"clear {cycle['clear'].get('clear_ms', 0):.1f} ms ({_mib(cycle['clear'].get('freed', 0))} freed), "
                f"resume {cycle['resume'].get('resume_ms', 0):.1f} ms"
            )
        if report.cycles:
            gpu_after, cpu_after = report.hit_rates_since_cycle()
            echo(
                f"  after the cycle the cache restarted empty and filled again: hit rate since then "
                f"GPU {gpu_after:.1%}, CPU {cpu_after:.1%}"
            )
        echo(
            f"  {report.verified_hit_blocks} cache-hit blocks checked on every rank against the digests taken "
            f"when they were computed: {'all bit-identical' if not report.errors else 'PROBLEMS'}"
        )
        echo(
            f"  end: GPU {st['gpu']['used']}/{st['gpu']['total']} blocks used, CPU {st['cpu']['used']}/"
            f"{st['cpu']['total']}, quarantined {sum(st['quarantined_blocks'].values())}; invariants "
            f"{'hold' if not report.errors else 'see below'}"
        )
        for error in report.errors:
            echo(f"  ERROR {error}")
        swaps_ok = all(s["swaps"][op]["issued"] == s["swaps"][op]["ok"] for op in ("swap_out", "swap_in"))
        if not swaps_ok:
            echo("  ERROR a swap did not end ok on a healthy cluster")
        if report.out_of_blocks:
            echo(f"  ERROR {report.out_of_blocks} requests found too few GPU blocks")
        return ok and report.ok and swaps_ok and not report.out_of_blocks and report.served == report.requests
