"""``zkv bench engine`` (or ``python -m zkv.harness.transformers.bench``): a
transformers model on the real bus, each figure beside a same-run baseline.

1. Swap-in vs recompute: a conversation of N tokens (1k, 4k) on the
   benchmark model; its prefill is timed (the recompute a swap-in replaces),
   then it is swapped out through the bus and swapped back into other block
   ids, timed, and its block bytes are checked.
2. Decode throughput of a batch: on a fresh engine before any zkv process or
   thread exists, then on the rig's replica 0 with its rank attached and the
   bus running (alternating with the first engine, now beside the running
   bus), best of each.  Measured on fresh engines, before the long conversations
   of part 1, so that both sides start from the same engine state.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

from ...rank.store import block_digests
from ...testing.models import random_llama, random_tokens, set_threads
from .rig import EngineRig, hold_ids


def _best(values: list[float]) -> float:
    return min(values)


def swap_vs_recompute(rig: EngineRig, tokens: int, reps: int) -> dict[str, Any]:
    ctrl, engines = rig.controller, rig.replicas
    prompt = random_tokens(tokens, tokens, vocab=4000)
    recompute, swap_in, swap_out, identical = [], [], [], True
    for rep in range(reps):
        name = f"c{tokens}_{rep}"
        start = time.perf_counter()
        ctrl.submit(name, prompt, 1)
        ctrl.run_until_idle()
        recompute.append(time.perf_counter() - start)
        ctrl.result(name)
        old = engines[0].block_table(name)
        before = [block_digests([e.block_rows()], e.block_table(name)) for e in engines]
        start = time.perf_counter()
        assert ctrl.swap_out(name), "swap-out failed"
        swap_out.append(time.perf_counter() - start)
        hold = hold_ids(engines, old)  # the swap-in must land in other ids
        start = time.perf_counter()
        assert ctrl.swap_in(name), "swap-in failed"
        swap_in.append(time.perf_counter() - start)
        for e, blocks in zip(engines, hold):
            e.return_blocks(blocks)
        identical &= before == [block_digests([e.block_rows()], e.block_table(name)) for e in engines]
        identical &= not set(old) & set(engines[0].block_table(name))
        ctrl.forget(name)
    kv_bytes = len(old) * engines[0].layout.block_bytes
    return {
        "tokens": tokens,
        "kv_bytes_per_rank": kv_bytes,
        "ranks": len(engines),
        "recompute_prefill_s": _best(recompute),
        "swap_in_s": _best(swap_in),
        "swap_out_s": _best(swap_out),
        "speedup": _best(recompute) / _best(swap_in),
        "bytes_identical": identical,
    }


def _decode_round(engine: Any, tag: str, batch: int, prompt: int, new_tokens: int) -> float:
    """Tokens/s of ``batch`` requests decoding together (their prefill is the untimed first step)."""
    for i in range(batch):
        engine.submit(f"{tag}_{i}", random_tokens(50 + i, prompt, vocab=4000), max_new_tokens=new_tokens, keep=False)
    engine.step()
    start = time.perf_counter()
    engine.run_until_idle()
    elapsed = time.perf_counter() - start
    for i in range(batch):
        engine.result(f"{tag}_{i}")
    return batch * (new_tokens - 1) / elapsed


def decode_without_zkv(engine: Any, batch: int, prompt: int, new_tokens: int, rounds: int) -> float:
    """Best tokens/s of a fresh engine in a process with no zkv running."""
    return max(_decode_round(engine, f"bare{r}", batch, prompt, new_tokens) for r in range(rounds))


def decode_with_zkv(
    rig: EngineRig, bare: Any, batch: int, prompt: int, new_tokens: int, rounds: int
) -> dict[str, float]:
    """Best tokens/s of the rig's replica 0 (a rank attached, the bus running) and, alternating with it, of the bare
    engine beside the running bus (what the process-level threads cost without the attach)."""
    attached: list[float] = []
    beside: list[float] = []
    for r in range(rounds):
        pair = [(attached, rig.replicas[0]), (beside, bare)]
        for out, engine in pair if r % 2 else pair[::-1]:  # alternate who goes first: the machine's load drifts
            out.append(_decode_round(engine, f"z{r}", batch, prompt, new_tokens))
    return {"with_zkv_tokens_per_s": max(attached), "bare_beside_running_bus_tokens_per_s": max(beside)}


def bench_engine(
    dtype: str = "fp32",
    sizes: tuple[int, ...] = (1024, 4096),
    reps: int = 1,
    ranks: int = 1,
    threads: int = 1,
    say: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    old = set_threads(threads)
    try:
        model = random_llama(0, dtype, "bench")
        blocks = max(sizes) // 32 * 2 + 16
        report: dict[str, Any] = {"model": "bench", "dtype": dtype, "torch_threads": threads, "ranks": ranks}
        rig = EngineRig(
            model,
            ranks=ranks,
            num_blocks=blocks,
            block_size=32,
            cpu_rows=max(sizes) // 32 + 8,
            max_batch_tokens=max(sizes),
            timeout=60.0,
        )
        shape = {"batch": 4, "prompt": 64, "new_tokens": 33, "rounds": 4}
        say("engine: decode throughput without zkv ...")
        bare = rig.new_engine()  # before the rig starts: no zkv thread or process exists yet
        without = decode_without_zkv(bare, **shape)
        with rig:
            report["parameters"] = rig.parameters
            say("engine: decode throughput with zkv attached ...")
            decode = decode_with_zkv(rig, bare, **shape)  # fresh replicas: no long conversation ran on them yet
            for n in sizes:
                say(f"engine: swap-in vs recompute, {n} tokens ...")
                report[f"swap_vs_recompute_{n}"] = swap_vs_recompute(rig, n, reps)
        report["decode"] = {
            **shape,
            "without_zkv_tokens_per_s": without,
            **decode,
            "ratio": decode["with_zkv_tokens_per_s"] / without,
        }
        return report
    finally:
        set_threads(old)


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"engine bench: random Llama 'bench' ({report['parameters'] / 1e6:.1f} M parameters, {report['dtype']}), "
        f"{report['ranks']} rank(s), torch threads {report['torch_threads']}"
    ]
    for key, r in report.items():
        if key.startswith("swap_vs_recompute_"):
            lines.append(
                f"  {r['tokens']:5d} tokens ({r['kv_bytes_per_rank'] / 2**20:.1f} MiB KV per rank): recompute prefill "
                f"{r['recompute_prefill_s'] * 1e3:.1f} ms | swap-in through the bus {r['swap_in_s'] * 1e3:.1f} ms "
                f"({r['speedup']:.0f}x), swap-out {r['swap_out_s'] * 1e3:.1f} ms; bytes "
                f"{'identical' if r['bytes_identical'] else 'MISMATCH'}"
            )
    d = report["decode"]
    lines.append(
        f"  decode, batch {d['batch']} x {d['new_tokens'] - 1} tokens: "
        f"with zkv attached {d['with_zkv_tokens_per_s']:.1f} tokens/s | "
        f"without zkv {d['without_zkv_tokens_per_s']:.1f} tokens/s (ratio {d['ratio']:.2f}); "
        f"a bare engine beside the running bus {d['bare_beside_running_bus_tokens_per_s']:.1f} tokens/s"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``python -m zkv.harness.transformers.bench [fp32|bf16] [RANKS]``"""
    dtype = argv[0] if argv else "fp32"
    ranks = int(argv[1]) if len(argv) > 1 else 1
    report = bench_engine(dtype, ranks=ranks, say=lambda m: print(m, file=sys.stderr))
    print(summary(report))
    print(json.dumps(report, default=lambda x: round(x, 4) if isinstance(x, float) else x), file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
