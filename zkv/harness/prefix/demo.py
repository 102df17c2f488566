"""The ``zkv up --demo`` workload: real swaps on every rank, checked bit for bit.

1. A round trip: fill blocks, swap them out, scribble over them, swap them
   back in, and compare per-rank digests; with a disk tier, the same through
   the disk (GPU -> CPU -> disk -> CPU -> GPU).
2. A chat workload served through the prefix cache manager
   (``zkv.harness.prefix.workload``): evenly popular multi-turn conversations with
   long turns, more KV than the GPU and the CPU hold together, so cold
   prefixes go down the tiers and come back when their conversation does.
   Every cache hit is checked bit for bit on every rank.  It runs twice on
   the same bus, the same requests each time: with the ranks' disk tier,
   then (after an RL-style pause / clear / resume cycle, ``zkv.cycle.prefix``,
   which empties every tier) with ``num_disk_blocks=0``, so the two
   requests/s figures and hit rates are measured side by side.  Without a
   disk tier both runs go without one.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

from ...client.client import Client
from ...cycle.prefix import pause_clear_resume
from ...prefix import PrefixCacheManager
from ...wire.layout import CacheLayout
from ...wire.moves import ROW_MOVES, TIER_ORDER
from ...wire.vocab import Op, Outcome, Tier
from .workload import ChatSpec, ChatWorkload, WorkloadReport, serve_workload

TIERS = TIER_ORDER


def round_trip(c: Client, layout: CacheLayout, echo: Callable[[str], None], disk_blocks: int = 0) -> bool:
    """Fill, swap out (and spill, with a disk tier), scribble, bring back, compare digests."""
    n = min(32, layout.gpu_blocks, layout.cpu_blocks, *([disk_blocks] if disk_blocks else []))
    rng = random.Random(7)
    gpu_ids = rng.sample(range(layout.gpu_blocks), n)
    cpu_ids = rng.sample(range(layout.cpu_blocks), n)
    steps = [c.run(Op.FILL, None, gpu_ids, tier=Tier.GPU, seed=1)]
    before = c.run(Op.CHECKSUM, gpu_ids, tier=Tier.GPU)
    steps += [c.run(Op.SWAP_OUT, gpu_ids, cpu_ids), c.run(Op.FILL, None, gpu_ids, tier=Tier.GPU, seed=2)]
    if disk_blocks:
        disk_ids = rng.sample(range(disk_blocks), n)
        steps += [
            c.run(Op.SPILL, cpu_ids, disk_ids),
            c.run(Op.FILL, None, cpu_ids, tier=Tier.CPU, seed=3),
            c.run(Op.LOAD, disk_ids, cpu_ids),
        ]
    steps.append(c.run(Op.SWAP_IN, cpu_ids, gpu_ids))
    after = c.run(Op.CHECKSUM, gpu_ids, tier=Tier.GPU)
    same = (
        before.ok
        and after.ok
        and all(before.per_rank[r]["digests"] == after.per_rank[r]["digests"] for r in before.per_rank)
    )
    via = " through the disk tier" if disk_blocks else ""
    echo(f"round trip of {n} blocks on {len(before.per_rank)} ranks{via}: {'bit-identical' if same else 'MISMATCH'}")
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


def _hit_rates(s: dict[str, Any]) -> str:
    hits = sum(s[f"{tier}_hit_rate"] for tier in TIERS)
    return (
        f"GPU {s['gpu_hit_rate']:.1%}, CPU {s['cpu_hit_rate']:.1%}, disk {s['disk_hit_rate']:.1%}, miss {1 - hits:.1%}"
    )


def _say_run(report: WorkloadReport, title: str, echo: Callable[[str], None]) -> list[str]:
    """What one run did; returns the problems it showed."""
    s, st = report.summary(), report.manager
    echo(
        f"  {title}: {report.served}/{report.requests} requests in {report.elapsed_s:.2f} s: "
        f"{s['requests_per_s']:.0f} requests/s ({report.compute_tasks} compute + "
        f"{report.checksum_tasks} checksum tasks besides the swaps)"
    )
    echo(f"    hit rate over {st['queried_blocks']} prompt blocks: {_hit_rates(s)}; {s['computed_blocks']} computed")
    for op in ROW_MOVES:
        sw = s["swaps"][op]
        if op.startswith("swap") or st["disk"]["total"]:
            outcomes = {k.value: sw[k] for k in Outcome if sw[k]}
            echo(
                f"    {op}: {sw['issued']} tasks, {sw['blocks']} blocks, {_mib(sw['bytes'])} across ranks,"
                f" outcomes {outcomes or '{}'}"
            )
    disk, dropped = st["disk"], s["dropped"]
    room = (
        f"the disk tier peaked at {disk['peak_used']}/{disk['total']} blocks"
        + (" (full)" if disk["peak_used"] == disk["total"] else "")
        if disk["total"]
        else "no disk tier"
    )
    echo(
        f"    dropped for want of room: {dropped['gpu']} GPU, {dropped['cpu']} CPU, {dropped['disk']} disk blocks;"
        f" {room}"
    )
    problems = []
    if not all(s["swaps"][op]["issued"] == s["swaps"][op][Outcome.OK] for op in s["swaps"]):
        problems.append(f"{title}: a swap, spill or load did not end ok on a healthy cluster")
    if disk["total"] and sum(dropped.values()) and disk["peak_used"] < disk["total"]:
        problems.append(f"{title}: blocks were dropped before the disk tier was full")
    if report.out_of_blocks:
        problems.append(f"{title}: {report.out_of_blocks} requests found too few GPU blocks")
    return problems


def why_disk_slower(with_disk: dict[str, Any], without: dict[str, Any]) -> str | None:
    """Why the run with the disk tier served fewer requests a second (``summary()`` of
    each run), or None when it did not: this demo runs no model, so a block it computes
    costs one fill task, less than one served from disk."""
    if with_disk["requests_per_s"] >= without["requests_per_s"]:
        return None
    saved = without["computed_blocks"] - with_disk["computed_blocks"]
    return (
        "why the disk tier is slower here: this demo runs no model, so a block it computes costs one fill task, "
        "less than a block served from disk (a load that reads it and checks its digest, then a swap-in); the disk "
        f"tier saved {saved} block computations, each a forward pass in a real engine"
    )


def _cycle(
    c: Client, manager: PrefixCacheManager, update: Callable[[], Any] | None, echo: Callable[[str], None]
) -> list[str]:
    """The RL trainer's pause / clear / resume between the runs: every tier starts empty again."""
    try:
        cycle = pause_clear_resume(c, manager, update=update)
    except Exception as err:  # noqa: BLE001 - reported, the demo goes on
        return [f"pause/clear/resume failed: {err}"]
    echo(
        f"  pause/clear/resume: drain {cycle['pause'].elapsed_ms:.1f} ms, "
        f"clear {cycle['clear'].elapsed_ms:.1f} ms ({_mib(cycle['clear'].freed)} freed), "
        f"resume {cycle['resume'].elapsed_ms:.1f} ms: every tier starts empty again"
    )
    return []


def run_demo(
    broker: str,
    layout: CacheLayout,
    requests: int,
    echo: Callable[[str], None] = print,
    update: Callable[[], Any] | None = None,
    progress_every: float = 3.0,
    disk_blocks: int = 0,
) -> bool:
    """Round trip, then ``requests`` chat requests through the prefix cache manager:
    half with the ranks' disk tier of ``disk_blocks`` (0: none), half without,
    with a pause / clear / resume cycle between them.

    ``update``: runs between the cycle's clear and its resume (with ``--attach``
    the engines reallocate their caches there); a progress line every
    ``progress_every`` seconds."""
    with Client(broker) as c:
        ok = round_trip(c, layout, echo)
        if disk_blocks:
            ok = round_trip(c, layout, echo, disk_blocks) and ok
        spec = ChatSpec.for_tiers(layout.gpu_blocks, layout.cpu_blocks, layout.block_size)
        each = max(1, requests // 2)
        tiers = f"{layout.gpu_blocks} GPU + {layout.cpu_blocks} CPU" + (f" + {disk_blocks} disk" if disk_blocks else "")
        echo(
            f"prefix cache: {each} chat requests twice ({spec.conversations} evenly popular conversations, turns of"
            f" {spec.turn_tokens[0] // layout.block_size}-{spec.turn_tokens[1] // layout.block_size} blocks), on "
            f"{tiers} blocks of {layout.block_size} tokens ({_mib(layout.block_bytes)} per block per rank)"
        )
        runs: list[tuple[str, WorkloadReport]] = []
        problems: list[str] = []
        manager = None
        for number, disk in enumerate((disk_blocks, 0)):
            if manager is not None:
                problems += _cycle(c, manager, update, echo)
            manager = PrefixCacheManager(
                c, layout.block_size, layout.gpu_blocks, layout.cpu_blocks, swap_timeout=10.0, num_disk_blocks=disk
            )
            report = serve_workload(
                c,
                manager,
                each,
                workload=ChatWorkload(layout.block_size, spec, seed=1),  # the same requests each run
                verify=True,
                on_request=Progress(each, echo, progress_every),
            )
            title = ("with the disk tier" if disk else "without a disk tier") if disk_blocks else f"run {number + 1}"
            problems += _say_run(report, title, echo)
            runs.append((title, report))
        if disk_blocks:
            a, b = (report.summary() for _, report in runs)
            hit_a, hit_b = (sum(x[f"{tier}_hit_rate"] for tier in TIERS) for x in (a, b))
            echo(
                f"  with vs without the disk tier: {a['requests_per_s']:.0f} vs {b['requests_per_s']:.0f} requests/s,"
                f" hit rate {hit_a:.1%} vs {hit_b:.1%}, {a['computed_blocks']} vs {b['computed_blocks']} blocks"
                " computed"
            )
            why = why_disk_slower(a, b)
            if why:
                echo(f"  {why}")
        verified = sum(report.verified_hit_blocks for _, report in runs)
        errors = [f"{title}: {error}" for title, report in runs for error in report.errors] + problems
        echo(
            f"  {verified} cache-hit blocks checked on every rank against the digests taken "
            f"when they were computed: {'all bit-identical' if not any(r.errors for _, r in runs) else 'PROBLEMS'}"
        )
        st = runs[-1][1].manager
        echo(
            f"  end: GPU {st['gpu']['used']}/{st['gpu']['total']} blocks used, CPU {st['cpu']['used']}/"
            f"{st['cpu']['total']}, quarantined {sum(st['quarantined_blocks'].values())}; invariants "
            f"{'hold' if not errors else 'see below'}"
        )
        for error in errors:
            echo(f"  ERROR {error}")
        return ok and not errors and all(r.served == r.requests for _, r in runs) and len(runs) == 2
