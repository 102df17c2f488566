"""Attached-cache copy speed beside a plain ``copy_`` of the same bytes, in one run.

Two engine layouts: per-layer K/V tensors (FastDeploy / zkv, one region per
tensor) and block-major (transformers' continuous-batching flat cache, one
region).  Ids are contiguous (one run per region) or scattered (a random
sample of the engine's blocks into shuffled tier rows: no runs at all).
The baseline copies one contiguous tensor of exactly the bytes moved.

``python -m zkv.harness.bench_copy`` prints the table; ``bench_copy()``
returns it as a dict (the integrator's ``zkv bench copy`` can print it)."""

from __future__ import annotations

import random
import statistics
import time
from functools import partial
from typing import Any, Callable

import torch

from ..rank.cache import layouts
from ..rank.cache.copier import CopyEngine
from ..rank.cache.regions import EngineCache
from ..rank.cache.tier import CpuTier


def _timed(fns: list[Callable[[], Any]], reps: int, device: torch.device) -> list[list[float]]:
    """Seconds of each of ``fns`` per rep, run interleaved (so load on a shared
    machine hits them alike), after one warm-up call each."""
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 1):
        for fn, acc in zip(fns, times):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:
                acc.append(time.perf_counter() - t0)
    return times


def _paired(base: list[float], ours: list[float]) -> float:
    """Median over reps of baseline time / our time (1.0: as fast as the plain copy)."""
    return statistics.median(b / o for b, o in zip(base, ours))


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
    if layout == "per_layer":
        shape = (engine_blocks, kv_heads, block_size, head_dim)
        ks = [torch.ones(shape, dtype=dtype, device=device) for _ in range(layers)]
        vs = [torch.ones(shape, dtype=dtype, device=device) for _ in range(layers)]
        return EngineCache.from_tensors(layouts.zkv_native(ks, vs))
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
) -> dict[str, Any]:
    """GB/s of swap_out / swap_in per layout and id pattern, and of the baseline copy_.

    ``threads`` sets torch's intra-op threads for the run (restored after);
    None keeps the process setting."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(blocks, layers, kv_heads, block_size, head_dim, dtype, reps, device, seed)
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
) -> dict[str, Any]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rng = random.Random(seed)
    engine_blocks = 2 * blocks
    patterns = {
        "contiguous": (list(range(blocks)), list(range(blocks))),
        "scattered": (rng.sample(range(engine_blocks), blocks), rng.sample(range(blocks), blocks)),
    }
    result: dict[str, Any] = {"blocks": blocks, "device": str(dev), "threads": torch.get_num_threads(), "layouts": {}}
    for layout in ("per_layer", "block_major"):
        cache = _engine(layout, engine_blocks, layers, kv_heads, block_size, head_dim, dtype, dev)
        tier = CpuTier.for_cache(cache.descriptor, rows=blocks)
        copier = CopyEngine(cache, tier)
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
        f"{result['blocks']} blocks on {result['device']}, {result['threads']} thread(s): GB/s, and x of a plain "
        "copy_ of the same bytes (interleaved in the same run, median of paired ratios)",
        f"{'layout':12} {'regions':>7} {'MiB':>5}  {'ids':10}"
        f" {'copy_ out':>9} {'swap_out':>14} {'copy_ in':>9} {'swap_in':>14}",
    ]
    for layout, row in result["layouts"].items():
        for name in ("contiguous", "scattered"):
            c = row[name]
            lines.append(
                f"{layout:12} {row['regions']:>7} {row['mib']:>5.0f}  {name:10} {c['copy_out_gbps']:>9.2f} "
                f"{c['out_gbps']:>6.2f} ({c['out_vs_copy']:.2f}x) {c['copy_in_gbps']:>9.2f} "
                f"{c['in_gbps']:>6.2f} ({c['in_vs_copy']:.2f}x)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(bench_copy()))
