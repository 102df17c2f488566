"""``zkv bench vllm``: the time to first token of a returning conversation
on a real vLLM engine, with zkv as its offload backend, beside recompute (no
connector) and beside the floor of any offload backend here (vLLM's own
offloading connector on an in-process torch copy, ``floor.py``), each on
an engine of its own, in the same run (docs/benchmarks.md).

The workload: ``conversations`` contexts of ``context`` tokens on a model
large enough that prefill costs; the engine's KV cache holds about one of
them, so a returning conversation's blocks are gone from vLLM's cache and
come back from the offload tier (or are recomputed).  Each returning turn
adds ``turn`` tokens; its first token is timed with a 1-token request, and
every engine's greedy tokens are compared at the end.

Then the zkv engine is stopped and started again on the same tiers (a warm
restart, docs/engine-vllm.md): each conversation returns once more, its
blocks served from the CPU tier file the first engine left, and its first
token is timed beside the warm engine's.

Then a model with two KV cache groups (``bench_groups``): Gemma 3, sliding
window (64 tokens) and full attention layers alternating, with zkv beside
its own recompute, and the bytes zkv moves per returning conversation beside
the same model with every layer full attention (one group), the same
workload, in the same run: a sliding-window group moves only its window.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable

from ...obs.status_view import table
from .group_rig import GroupEngine
from .models import gemma3
from .output import progress, ticking, vllm_output_to
from .rig import (
    BLOCK_TOKENS,
    BusProbe,
    ModelShape,
    floor_transfer,
    greedy,
    start_engine,
    stop_engine,
    ttft,
    write_llama,
    zkv_transfer,
)


def _workload(shape: ModelShape, conversations: int, context: int, seed: int = 3) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, shape.vocab) for _ in range(context)] for _ in range(conversations)]


def _run(
    llm: Any,
    contexts: list[list[int]],
    turn: int,
    rounds: int,
    name: str = "",
    forget: bool = False,
    around: Callable[[], None] | None = None,
) -> tuple[list[float], list[list[int]], list[list[int]]]:
    """TTFT of every returning turn, each conversation's last greedy reply, and its history
    (a bar over the visits on a terminal); ``forget``: vLLM's own prefix cache is reset
    before each return (all of it comes back from the offload tier, or is recomputed);
    ``around``: called before the first return and after the last (what the returns moved
    is read there)."""
    import random

    rng = random.Random(7)
    history = [list(c) for c in contexts]
    bar = progress(f"  {name}", len(history) * (rounds + 2), "visit")
    try:
        for h in history:  # first visit: prefill, and the offload backend stores it
            greedy(llm, h, 2)
            bar.update(1)
        if around is not None:
            around()
        times = []
        for _ in range(rounds):
            for h in history:
                h += [rng.randrange(1, 500) for _ in range(turn)]
                if forget:
                    llm.reset_prefix_cache()
                times.append(ttft(llm, h))
                h += greedy(llm, h, 2)[0]
                bar.update(1)
        if around is not None:
            around()
        last = []
        for h in history:
            last.append(greedy(llm, h, 8)[0])
            bar.update(1)
        return times, last, history
    finally:
        bar.close()


def _after_restart(llm: Any, history: list[list[int]], turn: int, vocab: int) -> list[float]:
    """TTFT of each conversation returning to a restarted engine (after one unrelated
    request: the engine's own first-request costs are not the tiers')."""
    import random

    rng = random.Random(11)
    greedy(llm, [rng.randrange(1, vocab) for _ in range(2 * BLOCK_TOKENS)], 1)
    return [ttft(llm, h + [rng.randrange(1, vocab) for _ in range(turn)]) for h in history]


def bench_vllm(
    quick: bool = False,
    say: Callable[[str], None] = print,
    zkv_extra: dict[str, Any] | None = None,
    floor: Callable[[int, int], dict[str, Any]] | None = None,
    log: Path | None = None,
) -> dict[str, Any]:
    """``zkv_extra``: more of zkv's settings (docs/engine-vllm.md) for its engine; ``floor``:
    the floor engine's ``--kv-transfer-config`` for (CPU blocks, block bytes), instead of the
    in-process torch copy (the GPU check puts vLLM's own CPU offloading there); ``log``: where
    vLLM's own output goes (``output.vllm_output_to``; None: this terminal)."""
    shape = ModelShape(layers=4 if quick else 8, hidden=256 if quick else 512, heads=8, kv_heads=8, vocab=512)
    context = 1024 if quick else 3072
    conversations, rounds, turn = 3, 2 if quick else 4, 64
    per_conv = -(-(context + (rounds + 1) * (turn + 2) + 16) // BLOCK_TOKENS)  # one more turn after the restart
    gpu_blocks = per_conv + 8  # about one conversation: the others are evicted between visits
    cpu_blocks = conversations * per_conv + 16
    max_len = per_conv * BLOCK_TOKENS
    contexts = _workload(shape, conversations, context)
    result: dict[str, Any] = {
        "model": {"layers": shape.layers, "hidden": shape.hidden, "kv_heads": shape.kv_heads},
        "context_tokens": context,
        "conversations": conversations,
        "gpu_blocks": gpu_blocks,
        "block_bytes": shape.block_bytes(),
    }
    with tempfile.TemporaryDirectory(prefix="zkv-bench-vllm-") as tmp, vllm_output_to(log):
        model = write_llama(Path(tmp) / "model", shape, seed=0)
        variants = {
            "recompute": None,
            "zkv": zkv_transfer(Path(tmp) / "bus", cpu_blocks=cpu_blocks, tier_dir=tmp, **(zkv_extra or {})),
            "torch_copy_floor": floor(cpu_blocks, shape.block_bytes()) if floor else floor_transfer(cpu_blocks),
        }
        tokens, histories = {}, {}
        for name, transfer in variants.items():
            say(f"vllm bench: {name} ...")
            with ticking("  starting vLLM"):
                llm = start_engine(model, transfer, gpu_blocks, max_len)
            try:
                if name == "zkv":
                    BusProbe(Path(tmp) / "bus").status(wait_ranks=1)
                times, tokens[name], histories[name] = _run(llm, contexts, turn, rounds, name)
            finally:
                stop_engine(llm)
                del llm
                gc.collect()
            result[name] = {
                "ttft_ms_p50": statistics.median(times) * 1000,
                "ttft_ms": [round(t * 1000, 1) for t in times],
            }
        say("vllm bench: zkv after a restart on the same tiers ...")
        with ticking("  starting vLLM"):
            llm = start_engine(model, variants["zkv"], gpu_blocks, max_len)
        try:
            probe = BusProbe(Path(tmp) / "bus")
            probe.status(wait_ranks=1)
            times = _after_restart(llm, histories["zkv"], turn, shape.vocab)
            served = probe.blocks_by_op(shape.block_bytes())
        finally:
            stop_engine(llm)
            del llm
            gc.collect()
        result["zkv_restarted"] = {
            "ttft_ms_p50": statistics.median(times) * 1000,
            "ttft_ms": [round(t * 1000, 1) for t in times],
            "blocks_served": served.get("swap_in", 0),
        }
        result["groups"] = bench_groups(quick, say)
    z, r, f = (result[k]["ttft_ms_p50"] for k in ("zkv", "recompute", "torch_copy_floor"))
    result["restart_vs_warm"] = result["zkv_restarted"]["ttft_ms_p50"] / z
    result["zkv_vs_recompute"] = z / r
    result["zkv_vs_floor"] = z / f
    result["tokens_identical"] = tokens["zkv"] == tokens["recompute"] == tokens["torch_copy_floor"]
    return result


def _mark(engine: GroupEngine, marks: list[tuple[int, dict[int, dict[str, int]]]]) -> None:
    """What zkv moved so far: the bytes vLLM loaded (``swap_in``) and the blocks per group."""
    marks.append((engine.probe.blocks_by_op(1).get("swap_in", 0), engine.blocks()))


def bench_groups(quick: bool = False, say: Callable[[str], None] = print) -> dict[str, Any]:
    """A returning conversation on Gemma 3 (two KV cache groups: sliding window and full
    attention): TTFT with zkv beside recompute and beside vLLM's own offloading connector on
    the in-process copy floor, and the bytes zkv moves per returning turn beside the same
    model with every layer full attention, each engine in turn, one run."""
    layers, hidden, head_dim, kv_heads = (4, 256, 64, 4) if quick else (8, 512, 64, 8)
    context = 1024 if quick else 3072
    conversations, rounds, turn = 3, 2 if quick else 4, 64
    per_conv = -(-(context + rounds * (turn + 2) + 16) // BLOCK_TOKENS)
    gpu_blocks = 2 * per_conv + 8  # vLLM checks a hybrid cache's room for a request per group
    cpu_blocks = 2 * conversations * per_conv + 16
    shape = {"layers": layers, "hidden": hidden, "kv_heads": kv_heads, "head_dim": head_dim}
    result: dict[str, Any] = {"model": {"family": "gemma3", **shape}, "context_tokens": context}
    contexts = _workload(ModelShape(vocab=512), conversations, context, seed=5)
    returns = conversations * rounds
    tokens: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="zkv-bench-groups-") as tmp:
        root = Path(tmp)
        models = {
            sliding: gemma3(root / f"m{int(sliding)}", seed=0, sliding=sliding, **shape) for sliding in (True, False)
        }
        floor = floor_transfer(cpu_blocks)
        variants = (("zkv", True), ("recompute", True), ("torch_copy_floor", True), ("zkv_full_attention", False))
        for name, sliding in variants:
            with_zkv = name.startswith("zkv")
            say(f"vllm bench, two KV cache groups: {name} ...")
            (root / name).mkdir()
            max_len = per_conv * BLOCK_TOKENS
            engine = GroupEngine(
                models[sliding], root / name, gpu_blocks, {"cpu_blocks": cpu_blocks}, max_model_len=max_len
            )
            marks: list[tuple[int, dict[int, dict[str, int]]]] = []
            try:
                with ticking("  starting vLLM"):
                    if with_zkv:
                        llm = engine.start().llm
                    else:
                        llm = start_engine(
                            models[sliding], floor if name == "torch_copy_floor" else None, gpu_blocks, max_len
                        )
                # Each return finds vLLM's cache empty: its whole context moves (or is recomputed),
                # so the bytes per return of the two models compare their groups, not what
                # vLLM's cache happened to keep of each.
                mark = partial(_mark, engine, marks) if with_zkv else None
                times, tokens[name], _ = _run(llm, contexts, turn, rounds, name, forget=True, around=mark)
                entry: dict[str, Any] = {"ttft_ms_p50": statistics.median(times) * 1000}
                if with_zkv:
                    (b0, g0), (b1, g1) = marks
                    entry["bytes_per_return"] = (b1 - b0) / returns
                    entry["served_per_group"] = {g: g1[g]["served"] - g0.get(g, {}).get("served", 0) for g in g1}
                result[name] = entry
            finally:
                if with_zkv:
                    engine.stop()
                else:
                    stop_engine(llm)
                gc.collect()
    result["zkv_vs_recompute"] = result["zkv"]["ttft_ms_p50"] / result["recompute"]["ttft_ms_p50"]
    result["zkv_vs_floor"] = result["zkv"]["ttft_ms_p50"] / result["torch_copy_floor"]["ttft_ms_p50"]
    result["bytes_vs_full_attention"] = (
        result["zkv"]["bytes_per_return"] / result["zkv_full_attention"]["bytes_per_return"]
        if result["zkv_full_attention"]["bytes_per_return"]
        else float("nan")
    )
    result["tokens_identical"] = tokens["zkv"] == tokens["recompute"] == tokens["torch_copy_floor"]
    return result


def _target(value: float, bound: float) -> str:
    return f"<= {bound}x: {'ok' if value <= bound else 'MISSED'}"


def groups_summary(res: dict[str, Any]) -> list[str]:
    """``bench_groups``' figures as a table."""
    m, z, full = res["model"], res["zkv"], res["zkv_full_attention"]
    per_group = ", ".join(f"group {g}: {n}" for g, n in sorted(z["served_per_group"].items()))
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    rows = [
        ["zkv, two groups", f"{z['ttft_ms_p50']:.0f} ms", mib(z["bytes_per_return"]), "", ""],
        [
            "recompute, two groups",
            f"{res['recompute']['ttft_ms_p50']:.0f} ms",
            "",
            f"zkv / recompute {res['zkv_vs_recompute']:.2f}x",
            _target(res["zkv_vs_recompute"], 0.5),
        ],
        [
            "in-process torch copy (the floor), two groups",
            f"{res['torch_copy_floor']['ttft_ms_p50']:.0f} ms",
            "",
            f"zkv / floor {res['zkv_vs_floor']:.2f}x",
            "",
        ],
        [
            "zkv, every layer full attention",
            f"{full['ttft_ms_p50']:.0f} ms",
            mib(full["bytes_per_return"]),
            f"bytes two groups / full {res['bytes_vs_full_attention']:.2f}x",
            f"< 1x: {'ok' if res['bytes_vs_full_attention'] < 1 else 'MISSED'}",
        ],
    ]
    return [
        f"vLLM, two KV cache groups: Gemma 3 ({m['layers']} layers, hidden {m['hidden']}; sliding window 64 and full"
        f" attention alternating), a returning conversation of {res['context_tokens']} tokens",
        f"greedy tokens identical across the three two-group engines: {res['tokens_identical']};"
        f" blocks zkv served per group: {per_group}",
        *(
            "  " + line
            for line in table(["engine", "time to first token p50", "moved per return", "ratio", "target"], rows)
        ),
    ]


def summary(res: dict[str, Any]) -> str:
    """The figures as a table, last: what ``zkv bench vllm`` prints (``--json``: ``res`` itself)."""
    m, restarted = res["model"], res["zkv_restarted"]
    rows = [
        ["zkv", f"{res['zkv']['ttft_ms_p50']:.0f} ms", "", ""],
        [
            "recompute (no connector)",
            f"{res['recompute']['ttft_ms_p50']:.0f} ms",
            f"zkv / recompute {res['zkv_vs_recompute']:.2f}x",
            _target(res["zkv_vs_recompute"], 0.5),
        ],
        [
            "in-process torch copy (the floor)",
            f"{res['torch_copy_floor']['ttft_ms_p50']:.0f} ms",
            f"zkv / floor {res['zkv_vs_floor']:.2f}x",
            _target(res["zkv_vs_floor"], 1.2),
        ],
        [
            "zkv after a warm restart",
            f"{restarted['ttft_ms_p50']:.0f} ms",
            f"restarted / zkv {res['restart_vs_warm']:.2f}x",
            _target(res["restart_vs_warm"], 1.5),
        ],
    ]
    return "\n".join(
        [
            f"vLLM, a returning conversation of {res['context_tokens']} tokens ({m['layers']} layers, hidden"
            f" {m['hidden']}; {res['conversations']} conversations, KV cache of {res['gpu_blocks']} blocks)",
            f"greedy tokens identical across the three engines: {res['tokens_identical']};"
            f" after the restart, {restarted['blocks_served']} blocks served from the tier file",
            *("  " + line for line in table(["engine", "time to first token p50", "ratio", "target"], rows)),
            *(groups_summary(res["groups"]) if "groups" in res else []),
        ]
    )
