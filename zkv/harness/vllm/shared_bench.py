"""``zkv bench shared``: a conversation served first by engine A, its next turn by
engine B of the same identity, on one shared store below both (the host tier, and
a Redis server when ``redis-server`` is installed): B's time to first token with
the prefix fetched from the store, beside B's recompute (its bus paused: every
lookup misses) and beside B serving a turn of the same length from its own CPU tier
(a conversation B served itself, evicted from vLLM's cache), all on the same two
engines in the same run; B's greedy
tokens from A's blocks are compared with its recompute (docs/benchmarks.md)."""

from __future__ import annotations

import gc
import random
import shutil
import statistics
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any, Callable

from ...obs.status_view import table
from ...rank.tiers.store_tier import open_store
from ...testing.redis_server import REDIS, RedisServer
from .output import vllm_output_to
from .rig import BLOCK_TOKENS, BusProbe, ModelShape, greedy, start_engine, stop_engine, ttft, write_llama, zkv_transfer

TARGETS = {"vs_recompute": 0.5, "vs_own_tier": 1.5}


def store_counts(store: str) -> dict[str, int]:
    """Values the store holds per namespace."""
    with closing(open_store(store)) as held:
        return {ns: n for ns, (n, _) in held.namespaces().items()}


def wait_grown(store: str, before: dict[str, int], want: int, within: float = 60.0) -> bool:
    """Until one namespace holds ``want`` more values than ``before`` (an engine's turn stored;
    other namespaces may shrink meanwhile, retired); False if not within ``within`` s."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if any(n - before.get(ns, 0) >= want for ns, n in store_counts(store).items()):
            return True
        time.sleep(0.05)  # nothing to wait on: the puts are in the engines' scheduler steps
    return False


def wait_stored(store: str, want: int, within: float = 60.0) -> int:
    """Until the store holds at least ``want`` values and no more arrive for a moment (A's
    puts trail its request's end, B's trail its own): read from the store itself, so that
    the wait disturbs neither engine's bus.  Returns how many it holds."""
    end = time.monotonic() + within
    last, since = -1, time.monotonic()
    with closing(open_store(store)) as held:
        while time.monotonic() < end:
            values = sum(n for n, _ in held.namespaces().values())
            if values != last:
                last, since = values, time.monotonic()
            elif values >= want and time.monotonic() - since >= 0.3:
                break
            time.sleep(0.05)  # nothing to wait on: the puts are in the engines' scheduler steps
    return last


def _pair(model: str, root: Path, store: str, gpu: int, cpu: int, max_len: int) -> tuple[Any, Any, BusProbe, BusProbe]:
    made = []
    for name in ("a", "b"):
        transfer = zkv_transfer(root / f"{name}-bus", cpu_blocks=cpu, tier_dir=None, store=store, status_interval_s=0.0)
        made.append(start_engine(model, transfer, gpu, max_len))
    probes = [BusProbe(root / f"{name}-bus") for name in ("a", "b")]
    for p in probes:
        p.status(wait_ranks=1)
    return made[0], made[1], probes[0], probes[1]


def _one(
    kind: str,
    store: str,
    model: str,
    shape: ModelShape,
    contexts: list[list[int]],
    root: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    per_conv = -(-(max(len(c) for c in contexts) + 128) // BLOCK_TOKENS)
    gpu, cpu = per_conv + 8, 4 * len(contexts) * per_conv + 16
    a, b, pa, pb = _pair(model, root, store, gpu, cpu, per_conv * BLOCK_TOKENS)
    rng = random.Random(5)
    words = lambda n: [rng.randrange(1, shape.vocab) for _ in range(n)]  # noqa: E731
    shared: list[float] = []
    recompute: list[float] = []
    own: list[float] = []
    same: list[bool] = []
    fetched: list[int] = []
    stored = 0
    try:
        # B's first request of this shape (a cached prefix and a turn) pays for its kernels once: not timed
        warm = words(len(contexts[0]))
        greedy(b, warm, 1)
        greedy(b, warm + words(66), 1)
        stored = wait_stored(store, 1)
        for context in contexts:
            say(f"shared bench ({kind}): a turn on A, the next on B ...")
            reply = greedy(a, context, 2)[0]
            stored = wait_stored(store, stored + len(context) // BLOCK_TOKENS)
            turn = context + reply + words(64)
            shared.append(ttft(b, turn))  # the prefix from A, through the store
            got = greedy(b, turn, 8)[0]
            # the baseline: a conversation B served itself, its next turn as long, from B's own CPU tier
            mine = words(len(context))
            mine += greedy(b, mine, 2)[0]
            stored = wait_stored(store, stored + len(context) // BLOCK_TOKENS)
            greedy(b, words(len(context)), 1)  # evicts it from B's KV cache
            own.append(ttft(b, mine + words(64)))
            with pb.client() as c:  # zkv out of the way: every lookup misses
                c.pause(timeout=30)
                b.reset_prefix_cache()
                try:
                    recompute.append(ttft(b, turn))
                    same.append(greedy(b, turn, 8)[0] == got)
                finally:
                    c.resume(timeout=30)
                    b.reset_prefix_cache()
            fetched.append(pb.blocks_by_op(shape.block_bytes()).get("get", 0) - sum(fetched))
    finally:
        for llm in (a, b):
            stop_engine(llm)
        gc.collect()
    p50 = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    return {
        "store": kind,
        "ttft_ms_p50": {"from_store": p50(shared), "recompute": p50(recompute), "own_tier": p50(own)},
        "vs_recompute": p50(shared) / p50(recompute),
        "vs_own_tier": p50(shared) / p50(own),
        "blocks_fetched": fetched,
        "values_in_store": stored,
        "tokens_identical": all(same),
    }


def bench_shared(quick: bool = False, say: Callable[[str], None] = print, log: Path | None = None) -> dict[str, Any]:
    """Both stores in turn (Redis where redis-server is installed); ``log``: where vLLM's own
    output goes (``output.vllm_output_to``; None: this terminal)."""
    with vllm_output_to(log):
        return _both(quick, say)


def _both(quick: bool, say: Callable[[str], None]) -> dict[str, Any]:
    shape = ModelShape(layers=4 if quick else 8, hidden=256 if quick else 512, heads=8, kv_heads=8, vocab=512)
    context = 1024 if quick else 3072
    rng = random.Random(3)
    contexts = [[rng.randrange(1, shape.vocab) for _ in range(context)] for _ in range(2 if quick else 3)]
    result: dict[str, Any] = {"context_tokens": context, "model": {"layers": shape.layers, "hidden": shape.hidden}}
    root = Path(tempfile.mkdtemp(prefix="zkv-bench-shared-", dir="/dev/shm"))
    try:
        model = write_llama(root / "model", shape, seed=0)
        result["host_tier"] = _one(
            "host tier", f"file://{root / 'host-tier'}?budget=4GiB", model, shape, contexts, root / "h", say
        )
        if REDIS is None:
            result["redis"] = {"skipped": "redis-server is not installed (bash tests/redis_setup.sh)"}
        else:
            server = RedisServer(root / "redis", maxmemory="2gb", timeout=5.0).start()
            try:
                result["redis"] = _one("redis", server.url, model, shape, contexts, root / "r", say)
            finally:
                server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def summary(res: dict[str, Any]) -> str:
    rows = []
    for name in ("host_tier", "redis"):
        r = res.get(name, {})
        if "skipped" in r:
            rows.append([name, "skipped", r["skipped"], "", ""])
            continue
        t = r["ttft_ms_p50"]
        rows.append(
            [
                r["store"],
                f"{t['from_store']:.0f} ms (recompute {t['recompute']:.0f}, own tier {t['own_tier']:.0f})",
                f"{r['vs_recompute']:.2f}x recompute ({'ok' if r['vs_recompute'] <= 0.5 else 'MISSED'}: <= 0.5x)",
                f"{r['vs_own_tier']:.2f}x own tier ({'ok' if r['vs_own_tier'] <= 1.5 else 'MISSED'}: <= 1.5x)",
                f"blocks fetched per turn {r['blocks_fetched']}, tokens identical: {r['tokens_identical']}",
            ]
        )
    head = f"vLLM, a turn moving from engine A to engine B ({res['context_tokens']}-token contexts):"
    return "\n".join([head, *("  " + line for line in table(["store", "B's TTFT p50", "", "", ""], rows))])
