"""Attached-cache copy speed beside a plain ``copy_`` of the same bytes, in one run.

The engine layouts zkv attaches to, each with the same model (``layers`` x K/V
pages): per-layer K and V tensors (FastDeploy, zkv's own shape: one region
and one buffer each), vLLM FlashAttention ``(2, blocks, ...)`` per layer (K
and V halves of one buffer), the canonical int8 ``(blocks, page_bytes)``
tensors vLLM's offloading spec hands a worker (``vllm.canonical_pages``),
SGLang token pools (a block is ``block_size`` slots) and block-major
(transformers' continuous-batching flat cache, one region).  Ids are
contiguous (one run per region), scattered (a random sample of the engine's
blocks into a shuffled run of tier rows) or scattered both ways (tier rows
sampled from twice as many too: no runs on either side).  The baseline
copies one contiguous tensor of exactly the bytes moved.

``python -m zkv.harness.copies.bench [LAYOUT ...] [--cpu-clock]
[--copy-threads=1|2]`` prints the table (with the copy threads a rank on this
machine takes, unless told); ``bench_copy()`` returns it as a dict
(``zkv bench copy`` prints it for one and for two copy threads)."""

from __future__ import annotations

import random
import statistics
import time
from functools import partial
from typing import Any, Callable

import torch

from ...engines import sglang, vllm
from ...rank.copies import cpu_copy
from ...rank.copies.copier import CopyEngine
from ...rank.memory import layouts
from ...rank.memory.regions import EngineCache
from ...rank.tiers.cpu_tier import CpuTier

# What a rep is timed with: wall time (what a task waits), or with ``--cpu-clock`` this process's CPU
# time, every thread's (a loaded 2-core machine preempts a copy at random; a large copy runs on two
# threads, ``cpu_copy.SPLIT_BYTES``, so this is its CPU cost, not its latency).
CLOCK: Callable[[], float] = time.perf_counter


def _timed(fns: list[Callable[[], Any]], reps: int, device: torch.device) -> list[list[float]]:
    """Seconds of each of ``fns`` per rep, run interleaved (so load on a shared
    machine hits them alike), after one warm-up call each."""
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 1):
        for fn, acc in zip(fns, times):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = CLOCK()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:
                acc.append(CLOCK() - t0)
    return times


def _paired(base: list[float], ours: list[float]) -> float:
    """Median over reps of baseline time / our time (1.0: as fast as the plain copy)."""
    return statistics.median(b / o for b, o in zip(base, ours))


LAYOUTS = ("fastdeploy", "vllm_flash", "vllm_canonical", "sglang", "block_major")
PATTERNS = ("contiguous", "scattered", "scattered_both")


def _engine(
    layout: str,
    engine_blocks: int,
    layers: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> EngineCache:
    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype, device=device)

    if layout == "fastdeploy":
        shape = (engine_blocks, kv_heads, block_size, head_dim)
        ks, vs = [ones(*shape) for _ in range(layers)], [ones(*shape) for _ in range(layers)]
        return EngineCache.from_tensors(layouts.zkv_native(ks, vs))
    if layout in ("vllm_flash", "vllm_canonical"):
        kv = {f"layer.{i}": ones(2, engine_blocks, block_size, kv_heads, head_dim) for i in range(layers)}
        if layout == "vllm_flash":
            return EngineCache.from_tensors(vllm.flash_attn(kv, null_block=None))
        pages = [t.view(torch.int8).view(2, engine_blocks, -1).unbind(0) for t in kv.values()]
        return EngineCache.from_tensors(vllm.canonical_pages([p for pair in pages for p in pair], null_block=None))
    if layout == "sglang":
        slots = engine_blocks * block_size
        ks, vs = (
            [ones(slots, kv_heads, head_dim) for _ in range(layers)],
            [ones(slots, kv_heads, head_dim) for _ in range(layers)],
        )
        return EngineCache.from_tensors(sglang.mha(ks, vs, block_size))
    es = torch.empty(0, dtype=dtype).element_size()
    flat = torch.ones(
        engine_blocks * layers * 2 * block_size * kv_heads * head_dim * es, dtype=torch.uint8, device=device
    )
    return EngineCache.from_tensors(layouts.per_layer({"cache_tensor": flat.view(engine_blocks, -1)}))


def bench_copy(
    blocks: int = 256,
    layers: int = 4,
    kv_heads: int = 8,
    block_size: int = 16,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = 15,
    device: str | None = None,
    seed: int = 0,
    threads: int | None = 1,
    layouts_run: tuple[str, ...] = (),
    copy_threads: int | None = None,
) -> dict[str, Any]:
    """GB/s of swap_out / swap_in per layout and id pattern, and of the baseline copy_.

    ``threads`` sets torch's intra-op threads for the run (restored after);
    None keeps the process setting.  ``copy_threads``: the copy engine's threads
    for a large copy (1 or 2; None: ``cpu_copy.copy_threads()``, what a rank takes)."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    split = (cpu_copy.copy_threads() if copy_threads is None else copy_threads) == 2
    try:
        return _run(blocks, layers, kv_heads, block_size, head_dim, dtype, reps, device, seed, layouts_run, split)
    finally:
        torch.set_num_threads(saved)


def _run(
    blocks: int,
    layers: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    reps: int,
    device: str | None,
    seed: int,
    layouts_run: tuple[str, ...],
    split: bool,
) -> dict[str, Any]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rng = random.Random(seed)
    engine_blocks = 2 * blocks
    patterns = {
        "contiguous": (list(range(blocks)), list(range(blocks))),
        "scattered": (rng.sample(range(engine_blocks), blocks), rng.sample(range(blocks), blocks)),
        "scattered_both": (rng.sample(range(engine_blocks), blocks), rng.sample(range(2 * blocks), blocks)),
    }
    result: dict[str, Any] = {
        "blocks": blocks,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "copy_threads": 2 if split else 1,
        "clock": "process CPU time" if CLOCK is time.process_time else "wall time",
        "layouts": {},
    }
    for layout in layouts_run or LAYOUTS:
        cache = _engine(layout, engine_blocks, layers, kv_heads, block_size, head_dim, dtype, dev)
        tier = CpuTier.for_cache(cache.descriptor, rows=2 * blocks)
        copier = CopyEngine(cache, tier)
        if copier.cpu is not None:
            copier.cpu.split = split
        nbytes = blocks * cache.descriptor.block_bytes
        src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        nb = dev.type == "cuda"
        row: dict[str, Any] = {"regions": len(cache.descriptor.regions), "mib": nbytes / 2**20}
        for name, (block_ids, rows) in patterns.items():
            base_out, t_out, base_in, t_in = _timed(
                [
                    partial(dst.copy_, src, non_blocking=nb),
                    partial(copier.swap_out, block_ids, rows),
                    partial(src.copy_, dst, non_blocking=nb),
                    partial(copier.swap_in, rows, block_ids),
                ],
                reps,
                dev,
            )
            gbps = {
                key: nbytes / statistics.median(ts) / 1e9
                for key, ts in (("out", t_out), ("in", t_in), ("copy_out", base_out), ("copy_in", base_in))
            }
            row[name] = {
                "out_gbps": gbps["out"],
                "in_gbps": gbps["in"],
                "copy_out_gbps": gbps["copy_out"],
                "copy_in_gbps": gbps["copy_in"],
                "out_vs_copy": _paired(base_out, t_out),
                "in_vs_copy": _paired(base_in, t_in),
            }
        result["layouts"][layout] = row
        cache.release()
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['blocks']} blocks on {result['device']}, {result['threads']} torch thread(s), "
        f"{result.get('copy_threads', 1)} copy thread(s), {result.get('clock', '')}: "
        "GB/s, and x of a plain copy_ of the same bytes (interleaved in the same run, median of paired ratios)",
        f"{'layout':14} {'regions':>7} {'MiB':>5}  {'ids':14}"
        f" {'copy_ out':>9} {'swap_out':>14} {'copy_ in':>9} {'swap_in':>14}",
    ]
    for layout, row in result["layouts"].items():
        for name in PATTERNS:
            c = row[name]
            lines.append(
                f"{layout:14} {row['regions']:>7} {row['mib']:>5.0f}  {name:14} {c['copy_out_gbps']:>9.2f} "
                f"{c['out_gbps']:>6.2f} ({c['out_vs_copy']:.2f}x) {c['copy_in_gbps']:>9.2f} "
                f"{c['in_gbps']:>6.2f} ({c['in_vs_copy']:.2f}x)"
            )
    return "\n".join(lines)


def before_after(rounds: int = 3, layouts_run: tuple[str, ...] = (), span: bool = False) -> str:
    """The table with the block-at-a-time CPU path (``cpu_copy.coalesce`` + ``copy_runs``: a
    ``memmove`` per page per region, or one strided copy per group, what every swap did before
    the copy plan) and with the plan, alternated in one process: each round beside its own baseline.
    With ``span``, "before" is the plan with a call per region or group for each run of tier rows
    (no ``cpu_copy.Span``) and "after" one call per run for every region."""
    planned, spanned = cpu_copy.CpuCopier.copy, cpu_copy.CpuCopier._span

    def block_at_a_time(self: Any, tier_ids: Any, engine_ids: Any, out: bool) -> None:
        runs = cpu_copy.coalesce(engine_ids, tier_ids) if out else cpu_copy.coalesce(tier_ids, engine_ids)
        cpu_copy.copy_runs(self.groups(), runs, out)

    def no_span(self: Any) -> None:
        return None

    variants: Any = (
        (("before: a call per region group", planned, no_span), ("after: one call per run", planned, spanned))
        if span
        else (("before: a block at a time", block_at_a_time, spanned), ("after: the copy plan", planned, spanned))
    )
    tables = []
    try:
        for i in range(rounds):
            for name, copy, span_of in variants:
                cpu_copy.CpuCopier.copy = copy  # type: ignore[method-assign]
                cpu_copy.CpuCopier._span = span_of  # type: ignore[method-assign]
                tables.append(f"--- round {i + 1}, {name}\n" + format_table(bench_copy(layouts_run=layouts_run)))
    finally:
        cpu_copy.CpuCopier.copy = planned  # type: ignore[method-assign]
        cpu_copy.CpuCopier._span = spanned  # type: ignore[method-assign]
    return "\n".join(tables)


if __name__ == "__main__":
    import sys

    args = tuple(a for a in sys.argv[1:] if not a.startswith("--"))
    copies = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--copy-threads=")), None)
    if "--cpu-clock" in sys.argv[1:]:
        CLOCK = time.process_time
    if "--span-before-after" in sys.argv[1:]:
        print(before_after(layouts_run=args, span=True))
    elif "--before-after" in sys.argv[1:]:
        print(before_after(layouts_run=args))
    else:
        print(format_table(bench_copy(layouts_run=args, copy_threads=copies)))
